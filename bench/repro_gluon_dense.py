"""How close does the warp-specialized Gluon engine come to cuBLAS on a dense matmul? Times
``tmoe.kernels.gluon_matmul.gluon_dense_matmul`` (one TMA producer warp, wgmma consumer warp groups,
persistent) under candidate tile configs against ``torch.matmul`` (cuBLAS) on the same bf16 operands,
``C = A @ B^T`` with B (N, K) as nn.Linear stores it, at square sizes and the MoE shapes' expert
GEMMs (all of one expert's rows), after checking every candidate against the float32 product.
Medians of ``triton.testing.do_bench_cudagraph``; the cuBLAS rate is the best of three trials.
Prints TFLOP/s per case and candidate. Hopper GPU only: ``python bench/repro_gluon_dense.py
[--out CSV]`` (``--out`` appends one row per case and provider: FIELDS)."""
from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
import triton

from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels.gluon_matmul import gluon_dense_matmul
from tmoe.tools.results import append_lines, git_commit

# (name, M, N, K): square sizes, then Mixtral-8x7B's up (2N = 28672) and down GEMMs, DeepSeek-V3's expert up
CASES = [("square", 4096, 4096, 4096), ("square", 8192, 8192, 8192), ("mixtral.up", 8192, 28672, 4096),
         ("mixtral.down", 8192, 4096, 14336), ("deepseek.up", 8192, 4096, 7168), ("qwen3.up", 8192, 1536, 2048)]
CANDIDATES = [GemmConfig(128, 256, 64, num_warps=8, num_stages=3), GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
              GemmConfig(128, 128, 64, num_warps=4, num_stages=4), GemmConfig(128, 256, 64, num_warps=8, num_stages=3,
                                                                               group_m=16)]
FIELDS = ["date", "gpu", "torch", "triton", "commit", "case", "M", "N", "K", "provider", "us", "tflops"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python bench/repro_gluon_dense.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="append the rows to this CSV")
    args = parser.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    env = [datetime.datetime.now().isoformat(timespec="seconds"), torch.cuda.get_device_name(), torch.__version__,
           triton.__version__, git_commit()]
    rows = []
    for name, m, n, k in CASES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ref = a.float() @ b.float().T
        flops = 2.0 * m * n * k
        cublas = min(triton.testing.do_bench_cudagraph(lambda: torch.matmul(a, b.T)) for _ in range(3))
        results = [("cublas", cublas)]
        for cfg in CANDIDATES:
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            gluon_dense_matmul(a, b, cfg, sms, out=out)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            label = f"gluon {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} g{cfg.group_m}"
            if not err < 1e-2:
                print(f"{name} {m}x{n}x{k} {label}: WRONG, relative error {err:.2e}")
                continue
            results.append((label, triton.testing.do_bench_cudagraph(lambda: gluon_dense_matmul(a, b, cfg, sms, out=out))))
        for provider, ms in results:
            tflops = flops / (ms * 1e-3) / 1e12
            print(f"{name:13s} {m:6d} {n:6d} {k:6d}  {provider:42s} {ms * 1e3:9.1f} µs {tflops:7.1f} TFLOP/s"
                  f"  {cublas / ms:5.2f}x cuBLAS")
            rows.append(env + [name, m, n, k, provider, f"{ms * 1e3:.1f}", f"{tflops:.1f}"])
    if args.out:
        append_lines(args.out, FIELDS, rows)


if __name__ == "__main__":
    main()
