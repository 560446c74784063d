#!/bin/bash
# Issue #17, one call on an nvidia-h200-x2 (or x4) machine: usage  bash bench/probes/multi_gpu/go.sh COMMIT
# 1. the expert-parallel tests with NCCL (all-gather and all-to-all against the single-process
#    reference, 2 and, on 4 GPUs, 4 ranks) and the CUDA-graph replays of one step of each on new
#    routing at world sizes 1, 2 (and 4);
# 2. the expert-parallel benchmark, Qwen3-30B-A3B and DeepSeek-V3 layer shapes, M per rank 1, 64, 1024,
#    both implementations, dispatch and combine timed on their own, bf16 and fp8 block;
# results under $OUT (copy them to bench/results/ with the date, GPU, torch and triton versions).
# NVLink multicast stays off, as the device README says.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
W=$(python -c "import torch; print(torch.cuda.device_count())")
{
    echo "# $(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $W, torch $(python -c 'import torch; print(torch.__version__)'), triton $(python -c 'import triton; print(triton.__version__)'), tree of $1"
    timeout 240 python -m pytest -q -p no:cacheprovider tests/test_expert_parallel.py -m gpu -rs 2>&1 | tail -8
} | tee $OUT/ep_gpu_tests.log
for dtype in bf16 fp8_block; do
    timeout 150 python -m tmoe bench-ep --world-size $W --shapes qwen3 deepseek --ms 1 64 1024 --dtype $dtype \
        2>&1 | grep -v Warn | tee $OUT/bench_ep_${dtype}_world$W.md | tail -30
done
