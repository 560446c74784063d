#!/bin/bash
# next session, after go2/go3: retune the bf16 large-M rows with the two-programs-per-SM tiles
# (tune.py LARGE_TILES, 3bfbda2) into $OUT/tuned, then bench the retuned rows against the shipped
# ones side by side (TMOE_CONFIG_DIR puts the new tables first)
export PYTHONPATH=$PWD
for shape in qwen3 deepseek mixtral; do
    timeout 150 python -m tmoe tune --shape $shape --ms 1024,4096,16384 --out $OUT/tuned 2>&1 | grep -v Warn | tail -8
done
timeout 60 python -m tmoe bench --dtype bf16 --ms 1024,4096,16384 --providers tmoe --rep-ms 40 --out $OUT/shipped 2>&1 | grep "tmoe:"
TMOE_CONFIG_DIR=$OUT/tuned timeout 60 python -m tmoe bench --dtype bf16 --ms 1024,4096,16384 --providers tmoe --rep-ms 40 \
    --out $OUT/retuned 2>&1 | grep "tmoe:"
