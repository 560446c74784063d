#!/bin/bash
# device call 4: the GPU tests after the w1_columns refactor of moe_gemm, and the fused-path tests
# that call 3's timeout cut (test_low_bit, test_activations, test_replay) on the GPU
export PYTHONPATH=$PWD
(timeout 250 python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -4) > $OUT/gpu_tests.log 2>&1; cat $OUT/gpu_tests.log
(timeout 130 python -m pytest -q tests/test_low_bit.py tests/test_activations.py tests/test_replay.py -k "fused" -p no:cacheprovider 2>&1 | tail -4) > $OUT/gpu_fused_tests.log 2>&1; cat $OUT/gpu_fused_tests.log
