#!/bin/bash
# #15's one cell where every low-bit scheme is slower than bf16: Mixtral M=256 (64 tokens per expert).
# swap_ab won there (2339 -> 1726 us, route_swap_probe_ded77e4) before the scaled int4 PTX made plain
# block_k 256 rows faster still (1126 us); swap_ab with the current dequantization was never timed.
# Retune the Mixtral low-bit rows at M = 64 and 256 against swap_ab tiles into $OUT/tuned, then bench
# int4/int8/mxfp4 there with the shipped and the retuned tables (the bf16 layer beside each).
export PYTHONPATH=$PWD
mkdir -p $OUT/tuned && cp tmoe/config/tuned/E=8,N=14336,*w*a16.json $OUT/tuned/
for quant in int4 int8 mxfp4; do
    timeout 120 python -m tmoe tune --shape mixtral --quant $quant --swap --ms 64,256 --out $OUT/tuned 2>&1 \
        | grep -v Warn | tail -6
done
for quant in int4 int8 mxfp4; do
    timeout 60 python -m tmoe bench --dtype $quant --shapes mixtral --ms 64,256 --rep-ms 40 --out $OUT/shipped_$quant \
        2>&1 | grep "tmoe"
    TMOE_CONFIG_DIR=$OUT/tuned timeout 60 python -m tmoe bench --dtype $quant --shapes mixtral --ms 64,256 --rep-ms 40 \
        --out $OUT/swap_$quant 2>&1 | grep "tmoe"
done
