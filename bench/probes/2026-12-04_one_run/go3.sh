#!/bin/bash
# device call: the GPU tests at the benchmarked tree first (215 s at f1d9b7f; more cases since: every route in
# the low-bit graph test, the all-gather EP graph replay), then ncu of the bf16 GEMMs at Qwen3-30B-A3B and
# DeepSeek-V3 M=4096 if time is left
export PYTHONPATH=$PWD
(timeout 420 python -m pytest -q -m gpu tests/ -p no:cacheprovider --durations=10 2>&1 | tail -20) > $OUT/gpu_tests.log 2>&1
cat $OUT/gpu_tests.log
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats"
for c in "qwen3 bf16 4096" "deepseek bf16 4096"; do
  f=$OUT/ncu_$(echo $c | tr ' ' _).txt
  timeout 60 ncu --clock-control none -k regex:_moe_gemm --launch-skip 4 --launch-count 2 $S python bench/probes/2026-12-04_low_bit/run1.py $c > $f 2>&1
  echo "== $c rc=$?"; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Grid Size|Dynamic Shared|Tensor|Stall" $f | head -40
done
