#!/bin/bash
# device probe 1: ncu on the low-bit GEMMs, GPU tests, regression re-checks
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
which ncu; ncu --version | tail -1
S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis"
for c in "mixtral int4 8" "deepseek int4 64" "mixtral bf16 8" "mixtral int4 256" "qwen3 int4 1"; do
  f=$OUT/ncu_$(echo $c | tr ' ' _).txt
  timeout 90 ncu --clock-control none -k regex:_moe_gemm --launch-skip 2 --launch-count 2 $S python bench/probes/2026-12-04_low_bit/run1.py $c > $f 2>&1
  echo "== $c rc=$?"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Grid Size|Shared Memory Configuration Size|Dynamic Shared" $f | head -40
done
echo "== GPU tests"
(timeout 200 python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -4) > $OUT/gpu_tests.log 2>&1; cat $OUT/gpu_tests.log
(timeout 150 python -m pytest -q tests/test_persistent.py tests/test_tma.py tests/test_low_bit.py -p no:cacheprovider 2>&1 | tail -4) > $OUT/gpu_persistent_swap.log 2>&1; cat $OUT/gpu_persistent_swap.log
