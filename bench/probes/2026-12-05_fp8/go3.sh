#!/bin/bash
# device call 3 of 2026-12-05 (commit $1): bf16 large-M rows against the tiles that fit twice in an SM
# (pair_tiles_probe.py, retuned tables into /tmp/pair, back as pair.tgz), then the layer at M = 1024-16384
# with the shipped and the retuned tables, one process each
export PYTHONPATH=$PWD
timeout 230 python bench/probes/2026-12-05_fp8/pair_tiles_probe.py /tmp/pair 2>&1 | grep -v Warn | tee $OUT/pair_tiles.log
tar czf $OUT/pair.tgz -C /tmp pair
for t in shipped pair; do
    echo "=== $t tables"
    dir=$([ $t = pair ] && echo /tmp/pair)
    TMOE_CONFIG_DIR=$dir timeout 75 python -m tmoe bench --dtype bf16 --ms 1024,4096,16384 --providers tmoe --rep-ms 40 \
        --out /tmp/b_$t --commit "$1" 2>&1 | grep -v Warning | tee -a $OUT/pair_bench.log | grep -E "tmoe:|ceilings"
done
