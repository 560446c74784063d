#!/bin/bash
# device call 1 of 2026-12-05 (commit $1): the GPU tests (4 xdist workers: Triton compiles dominate),
# then every shipped fp8 row at M = 1-256 timed against swap_ab tiles (tune --swap prints, per GEMM, the
# table's time and the best swap_ab time; the tables come back as tuned.tgz: names with '=' and ','
# do not come back as files)
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
(timeout 230 python -m pytest -q -m gpu tests/ -n 4 -p no:cacheprovider --durations=10 2>&1 | tail -25) > $OUT/gpu_tests.log 2>&1
cat $OUT/gpu_tests.log
mkdir -p /tmp/t/tuned && cp tmoe/config/tuned/*fp8_w8a8* /tmp/t/tuned/
for quant in fp8_block fp8_token; do
    for shape in qwen3 mixtral deepseek; do
        echo "=== $shape $quant"
        timeout 52 python -m tmoe tune --shape $shape --quant $quant --swap --ms 1,8,64,256 --out /tmp/t/tuned 2>&1 \
            | grep -v Warn | tee -a $OUT/tune_swap.log | grep -v "^    "
    done
done
tar czf $OUT/tuned.tgz -C /tmp/t tuned
