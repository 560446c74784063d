#!/bin/bash
# device call 2 of 2026-12-05 (commit $1): the README's fp8 tables, block 128x128 then per-token, each one
# run with its own ceilings and the stage breakdown; then align_probe.py (decides SORT_MAX_SLOTS)
export PYTHONPATH=$PWD
R=/tmp/r; mkdir -p $R  # tarred into $OUT/results.tgz at the end (at most 8 files come back)
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
for dtype in fp8_block fp8_token; do
    timeout 170 python -m tmoe bench --dtype $dtype --stages --rep-ms 40 --out $R/$dtype --commit "$1" 2>&1 \
        | grep -v Warning | tee $R/bench_$dtype.log | grep -E "^#|stopped|Error" | tail -8
done
timeout 100 python bench/probes/2026-12-04_one_run/align_probe.py 2>&1 | grep -v Warn | tee $R/align_probe.log
tar czf $OUT/results.tgz -C $R .
