#!/bin/bash
# device call 3: the GPU tests at the benchmarked tree, then every route at the decode Ms (the
# cells where the route is the lever: which path is fastest at M = 1-16 on each shape)
export PYTHONPATH=$PWD
(timeout 300 python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -6) > $OUT/gpu_tests.log 2>&1; cat $OUT/gpu_tests.log
timeout 240 python -m tmoe bench --dtype bf16 --ms 1,2,4,8,16 --routes auto,sorted,direct,slots,fused --providers tmoe \
    --rep-ms 40 --out $OUT/routes --commit "$1" 2>&1 | grep -v Warning | tee $OUT/routes.log | grep -E "tmoe" | tail -80
