"""``python -m tmoe tune``: search tile configs on the GPU and write a tuned table.

For each M the two GEMMs are timed separately over a candidate list (the align block size is
shared, so the pair with the best summed time wins). Results are written after every M, and
M values already in the output file are skipped, so an interrupted run resumes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tmoe.config import GemmConfig, MoEConfig, config_file_name, device_name, save_table
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.moe_gemm import Routing, invoke_moe_gemm

SHAPES = {"mixtral": (8, 14336, 4096, 2), "qwen3": (128, 768, 2048, 8), "deepseek": (256, 2048, 7168, 8)}
DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# (block_n, block_k, num_warps, num_stages); up GEMM tiles load 2 * block_n weight rows
SMALL_TILES = [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3),
               (128, 64, 4, 5)]
LARGE_TILES = [(64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3)]


def block_ms(m: int, e: int, topk: int) -> list[int]:
    """The two largest block sizes that tokens-per-expert can fill (at least 16)."""
    per_expert = m * topk / e
    return [bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * per_expert)][-2:]


def candidates(block_m: int, gated: bool) -> list[GemmConfig]:
    tiles = SMALL_TILES if block_m <= 32 else LARGE_TILES
    return [GemmConfig(block_m, bn, bk, 8, w, s) for bn, bk, w, s in tiles if not (gated and bn > 128)]


def _time_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def tune_m(m: int, w1: torch.Tensor, w2: torch.Tensor, topk: int) -> tuple[MoEConfig, float]:
    """Best config at ``m`` tokens and its summed GEMM time in µs."""
    e, n, k = w2.shape[0], w2.shape[2], w2.shape[1]
    dtype = w1.dtype
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    ids = torch.topk(torch.randn(m, e, device="cuda"), topk).indices.to(torch.int32)
    inter = torch.empty(m * topk, n, device="cuda", dtype=dtype)
    out = torch.empty(m * topk, k, device="cuda", dtype=dtype)
    best: tuple[MoEConfig, float] | None = None
    for bm in block_ms(m, e, topk):
        s, eids, ntpp = moe_align_block_size(ids, bm, e)
        up_route, down_route = Routing(s, eids, ntpp, m * topk, topk), Routing(s, eids, ntpp, m * topk, 1)

        def fastest(gated: bool):
            timed = []
            for cfg in candidates(bm, gated):
                a, w, o, r = (x, w1, inter, up_route) if gated else (inter, w2, out, down_route)
                try:
                    timed.append((_time_us(lambda: invoke_moe_gemm(a, w, o, cfg, gated=gated, routing=r)), cfg))
                except Exception as err:  # a config that does not fit shared memory: skip it
                    print(f"    skip {cfg}: {type(err).__name__}", flush=True)
            return min(timed, key=lambda t: t[0])

        t_up, up = fastest(True)
        t_down, down = fastest(False)
        if best is None or t_up + t_down < best[1]:
            best = (MoEConfig(up, down), t_up + t_down)
    return best


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tmoe tune", description=__doc__)
    ap.add_argument("--shape", required=True, help=f"one of {sorted(SHAPES)} or E,N,K,topk")
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "configs"))
    args = ap.parse_args(argv)
    e, n, k, topk = SHAPES.get(args.shape) or tuple(int(v) for v in args.shape.split(","))
    path = Path(args.out) / config_file_name(e, n, device_name(torch.device("cuda")), None)
    path.parent.mkdir(parents=True, exist_ok=True)
    table: dict[int, MoEConfig] = {}
    if path.is_file():
        raw = json.loads(path.read_text())
        table = {int(m): MoEConfig(GemmConfig(**r["up"]), GemmConfig(**r["down"])) for m, r in raw.items()}
    ms = [int(v) for v in args.ms.split(",")]
    dtype = getattr(torch, args.dtype)
    w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=dtype) / k**0.5
    w2 = torch.randn(e, k, n, device="cuda", dtype=dtype) / n**0.5
    for i, m in enumerate(ms):
        if m in table:
            print(f"[{i + 1}/{len(ms)}] M={m}: already tuned", flush=True)
            continue
        t0 = time.time()
        cfg, us = tune_m(m, w1, w2, topk)
        table[m] = cfg
        save_table(path, table)
        print(f"[{i + 1}/{len(ms)}] M={m}: {us:.1f} us  up={cfg.up} down={cfg.down} ({time.time() - t0:.0f} s)",
              flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
