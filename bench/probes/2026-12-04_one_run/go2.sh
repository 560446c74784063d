#!/bin/bash
# device call 2: the fp8 benchmarks (block 128x128, then per-token), every shape and M, with the
# stage breakdown, each its own run with its own ceilings (results under $OUT/fp8_*); then every
# bf16 route at the decode Ms (which path is fastest at M = 1-16 on each shape); then gemm_bounds.py
# and align_probe.py (the sorting align program against the three launches)
export PYTHONPATH=$PWD
for dtype in fp8_block fp8_token; do
    timeout 150 python -m tmoe bench --dtype $dtype --stages --rep-ms 40 --out $OUT/$dtype --commit "$1" 2>&1 \
        | grep -v Warning | tee $OUT/bench_$dtype.log | grep -E "^#|tmoe:|stopped|Error" | tail -25
done
timeout 150 python -m tmoe bench --dtype bf16 --ms 1,2,4,8,16 --routes auto,sorted,direct,slots,fused --providers tmoe \
    --rep-ms 40 --out $OUT/routes --commit "$1" 2>&1 | grep -v Warning | tee $OUT/routes.log | grep -E "tmoe" | tail -80
timeout 150 python bench/probes/2026-12-04_one_run/gemm_bounds.py 2>&1 | grep -v Warn | tee $OUT/gemm_bounds.log
timeout 120 python bench/probes/2026-12-04_one_run/align_probe.py 2>&1 | grep -v Warn | tee $OUT/align_probe.log
