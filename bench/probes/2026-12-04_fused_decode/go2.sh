#!/bin/bash
# device call 3: the GPU tests at the landed tree, the fused-path tests on the GPU, probe3
export PYTHONPATH=$PWD
timeout 90 python bench/probes/2026-12-04_fused_decode/probe3.py 2>&1 | grep -v Warn | tee $OUT/probe3.log
(timeout 250 python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -6) > $OUT/gpu_tests.log 2>&1; cat $OUT/gpu_tests.log
(timeout 180 python -m pytest -q -x tests/test_fused_experts.py tests/test_low_bit.py tests/test_activations.py tests/test_replay.py -k "fused" -p no:cacheprovider 2>&1 | tail -6) > $OUT/gpu_fused_tests.log 2>&1; cat $OUT/gpu_fused_tests.log
