#!/bin/bash
# Low-bit decode rows with honest stage counts. Until 2026-12-04 the launcher's shared-memory fit counted
# low-bit weight tiles at the activations' 2 bytes a value (4x an int4 code's), so 17 shipped rows (the
# block_k 256 decode tiles at 3 stages) ran, and were timed, with 2 stages (one shared-memory buffer); they
# are now pinned to what ran, and the fit counts packed bytes. Retune int4 at M = 1, 8, 64 for Qwen3-30B-A3B
# and Mixtral into $OUT/retuned (every candidate now runs the stages it names), then bench shipped vs retuned.
export PYTHONPATH=$PWD
for shape in qwen3 mixtral; do
    timeout 200 python -m tmoe tune --shape $shape --quant int4 --ms 1,8,64 --out $OUT/retuned 2>&1 | grep -v Warn | tail -5
done
timeout 60 python -m tmoe bench --dtype int4 --shapes qwen3,mixtral --ms 1,8,64 --rep-ms 40 --out $OUT/shipped 2>&1 | grep "tmoe"
TMOE_CONFIG_DIR=$OUT/retuned timeout 60 python -m tmoe bench --dtype int4 --shapes qwen3,mixtral --ms 1,8,64 --rep-ms 40 \
    --out $OUT/retuned_bench 2>&1 | grep "tmoe"
