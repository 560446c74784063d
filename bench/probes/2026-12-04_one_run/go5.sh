#!/bin/bash
# fp8 decode with swap_ab tiles. The shipped fp8 rows at block_m 16-32 compile (sm_90, Triton 3.6,
# compile-only, fp8_swap_ptx.py) to mma.sync with every fp8 weight converted to fp16 first
# (Qwen3 up 16x(2x128)x128: 64 mma.sync, 160 cvt.rn.f16x2.e4m3x2, 202 registers); swap_ab tiles put
# the weights in wgmma's M and take fp8 natively (8 wgmma e4m3, no conversion, 70 registers).
# Retune those rows against swap_ab tiles (tune --swap keeps the faster of the two per GEMM) into
# $OUT/tuned, then bench the layer with the shipped and the retuned tables side by side.
export PYTHONPATH=$PWD
mkdir -p $OUT/tuned && cp tmoe/config/tuned/*fp8_w8a8* $OUT/tuned/
for quant in fp8_block fp8_token; do
    for shape in qwen3 mixtral deepseek; do
        timeout 100 python -m tmoe tune --shape $shape --quant $quant --swap --ms 1,8,64,256 --out $OUT/tuned 2>&1 \
            | grep -v Warn | tail -12
    done
done
for dtype in fp8_block fp8_token; do
    timeout 60 python -m tmoe bench --dtype $dtype --ms 1,8,64,256 --providers tmoe --rep-ms 40 --out $OUT/shipped_$dtype \
        2>&1 | grep "tmoe:"
    TMOE_CONFIG_DIR=$OUT/tuned timeout 60 python -m tmoe bench --dtype $dtype --ms 1,8,64,256 --providers tmoe --rep-ms 40 \
        --out $OUT/swap_$dtype 2>&1 | grep "tmoe:"
done
