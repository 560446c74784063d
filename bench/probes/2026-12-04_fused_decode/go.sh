#!/bin/bash
# device call 1: the GPU tests (the fused decode path on the GPU, the persistent/TMA refactor of
# 3bb13ec..7a3b0ba), the fused decode probe, the GPT-OSS mxfp4 heuristic probe
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
(timeout 170 python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -4) > $OUT/gpu_tests.log 2>&1; cat $OUT/gpu_tests.log
(timeout 120 python -m pytest -q -x tests/test_persistent.py tests/test_tma.py tests/test_low_bit.py tests/test_fused_experts.py tests/test_activations.py -k "fused or persistent or tma" -p no:cacheprovider 2>&1 | tail -4) > $OUT/gpu_fused_tests.log 2>&1; cat $OUT/gpu_fused_tests.log
timeout 230 python bench/probes/2026-12-04_fused_decode/probe1.py 2>&1 | tee $OUT/probe1.log | grep -v Warning
timeout 60 python bench/probes/2026-12-04_low_bit/probe7.py 2>&1 | tee $OUT/probe7.log
