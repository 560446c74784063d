#!/bin/bash
export PYTHONPATH=$PWD
echo "== re-checks"
for i in 1 2; do
timeout 60 python -m tmoe bench --dtype bf16 --shapes mixtral --ms 8 --providers tmoe --rep-ms 100 --out $OUT/r 2>&1 | tail -3
timeout 60 python -m tmoe bench --dtype bf16 --shapes qwen3 --ms 4096 --providers tmoe --rep-ms 100 --out $OUT/r 2>&1 | tail -3
timeout 60 python -m tmoe bench --dtype fp8_block --shapes mixtral --ms 8 --providers tmoe --rep-ms 100 --out $OUT/r 2>&1 | tail -3
done
rm -rf $OUT/r
