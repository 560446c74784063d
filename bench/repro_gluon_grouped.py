"""Which tiles should the Gluon engine's grouped GEMMs use, and where does it beat the ``tl`` core?
Times the grouped core's up and down GEMMs alone (``invoke_grouped_gemm`` on expert-sorted rows, as
the layer's grouped route runs them) on the Gluon engine under candidate tile configs and on the
``tl`` core under its shipped config, at the Mixtral-8x7B and Qwen3-30B-A3B sizes, bf16, after
checking each candidate's output against the ``tl`` core's (relative error < 1e-2). Medians of
``triton.testing.do_bench_cudagraph``. Hopper GPU only: ``python bench/repro_gluon_grouped.py
[--out CSV]`` (``--out`` appends one row per case, GEMM and candidate: FIELDS)."""
from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
import triton

from tmoe.config import grouped_config
from tmoe.kernels.activation import Activation
from tmoe.kernels import gluon_grouped
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels.moe_grouped_gemm import invoke_grouped_gemm
from tmoe.kernels.operands import Routing
from tmoe.kernels.sorted_rows import sorted_rows
from tmoe.runtime.gluon import override_engine
from tmoe.tools.results import append_lines, git_commit

# (name, M, E, N, K, topk)
CASES = [("mixtral", 1024, 8, 14336, 4096, 2), ("mixtral", 4096, 8, 14336, 4096, 2),
         ("qwen3", 4096, 128, 768, 2048, 8)]
# (config, gluon_grouped.SPLIT_DOWN): the down GEMM's tile as one accumulator or two halves
CANDIDATES = {
    "up": [(GemmConfig(128, 128, 64, num_warps=8, group_m=g), True) for g in (8, 16)],
    "down": [(GemmConfig(128, 256, 64, num_warps=8, group_m=g), split) for g in (8, 16) for split in (False, True)],
}
FIELDS = ["date", "gpu", "torch", "triton", "commit", "case", "M", "gemm", "engine", "config", "us"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python bench/repro_gluon_grouped.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="append the rows to this CSV")
    args = parser.parse_args()
    torch.manual_seed(0)
    env = [datetime.datetime.now().isoformat(timespec="seconds"), torch.cuda.get_device_name(), torch.__version__,
           triton.__version__, git_commit()]
    rows = []
    for name, m, e, n, k, topk in CASES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        w2 = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) / n**0.5
        ids = torch.randint(0, e, (m, topk), device="cuda", dtype=torch.int32)
        shipped = grouped_config()
        sorted_ids, expert_ids, padded = moe_align_block_size(ids, shipped.up.block_m, e)
        em = sorted_ids.shape[0]
        up_rows = Routing(sorted_ids, expert_ids, padded, m * topk, topk)
        down_rows = Routing(sorted_ids, expert_ids, padded, m * topk, 1)
        x_sorted = torch.empty(em, k, device="cuda", dtype=torch.bfloat16)
        sorted_rows(x, up_rows, x_sorted)
        inter = torch.zeros(em, n, device="cuda", dtype=torch.bfloat16)
        y = torch.zeros(m * topk, k, device="cuda", dtype=torch.bfloat16)
        gemms = {
            "up": lambda cfg: invoke_grouped_gemm(x_sorted, w1, inter, cfg, up_rows, gated=True, activation=Activation()),
            "down": lambda cfg: invoke_grouped_gemm(inter, w2, y, cfg, down_rows, gated=False),
        }
        for gemm, run in gemms.items():
            cfg_tl = getattr(shipped, gemm)
            out = inter if gemm == "up" else y
            with override_engine("tl"):
                run(cfg_tl)
                ref = out.float().clone()
                results = [("tl", cfg_tl, "", triton.testing.do_bench_cudagraph(lambda: run(cfg_tl)))]
            with override_engine("gluon"):
                for cfg, split in CANDIDATES[gemm]:
                    gluon_grouped.SPLIT_DOWN = split
                    out.zero_()
                    run(cfg)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        print(f"{name} M={m} {gemm} gluon {cfg}: WRONG, relative error {err:.2e}")
                        continue
                    results.append(("gluon", cfg, " split" if split and gemm == "down" else "",
                                    triton.testing.do_bench_cudagraph(lambda: run(cfg))))
            base = results[0][3]
            for engine, cfg, split, ms in results:
                label = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} g{cfg.group_m}{split}"
                print(f"{name:8s} M={m:5d} {gemm:4s} {engine:5s} {label:24s} {ms * 1e3:9.1f} µs  {base / ms:5.2f}x tl")
                rows.append(env + [name, m, gemm, engine, label, f"{ms * 1e3:.1f}"])
    if args.out:
        append_lines(args.out, FIELDS, rows)


if __name__ == "__main__":
    main()
