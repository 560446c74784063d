"""Which tiles make the backward kernels fastest? Times moe_grad_act, moe_grad_input and
moe_grad_weight (dW1 and dW2) under candidate tiles at the Qwen3-30B-A3B, Mixtral-8x7B and
DeepSeek-V3 layer shapes (bf16, random top-k routing) and prints each kernel's best beside the
shipped tiles' time. GPU only:
``python bench/repro_grad_tiles.py [--ms 4096] [--shapes ...] [--kernels act input weight] [--out CSV]``
(``--out`` appends one row per kernel and candidate: FIELDS)."""
from __future__ import annotations

import argparse
import csv
import datetime
import subprocess
from pathlib import Path

import torch
import triton

from tmoe.config.backward import act_tiles, grad_block_m, weight_tiles
from tmoe.kernels.activation import Activation
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.grad_config import ActTiles, InputTiles, WeightTiles
from tmoe.kernels.moe_grad_act import moe_grad_act
from tmoe.kernels.moe_grad_input import moe_grad_input
from tmoe.kernels.moe_grad_weight import moe_grad_weight

SHAPES = {"qwen3-30b-a3b": (128, 768, 2048, 8), "mixtral-8x7b": (8, 14336, 4096, 2),
          "deepseek-v3": (256, 2048, 7168, 8)}
# tma=False: rows gathered and weights read by pointers; the others load every operand by TMA (moe_grad_act
# from aligned-row copies of grad_out and x); ActTiles(block_n, block_k, num_warps, num_stages)
ACT = [ActTiles(128, 64, 8, 3, tma=False), ActTiles(128, 32, 8, 4, tma=False), ActTiles(64, 64, 8, 3),
       ActTiles(64, 64, 8, 4), ActTiles(128, 64, 8, 3), ActTiles(128, 32, 8, 4), ActTiles(64, 64, 4, 3),
       ActTiles(64, 32, 4, 4), ActTiles(64, 128, 8, 3), ActTiles(128, 64, 8, 4),
       # g_first: g = go @ w2 as its own GEMM first, then the two dots of the recomputed pre-activation
       ActTiles(64, 64, 8, 3, g_first=True), ActTiles(64, 64, 8, 4, g_first=True),
       ActTiles(128, 64, 8, 3, g_first=True), ActTiles(128, 32, 8, 4, g_first=True),
       ActTiles(64, 64, 4, 3, g_first=True),
       ActTiles(64, 64, 8, 3, tma=False, g_first=True), ActTiles(128, 64, 8, 3, tma=False, g_first=True)]
INPUT = [InputTiles(tma=False), InputTiles(), InputTiles(128, 64, 4, 3), InputTiles(128, 64, 8, 3),
         InputTiles(256, 64, 8, 4), InputTiles(128, 32, 4, 4), InputTiles(64, 64, 4, 4), InputTiles(256, 32, 8, 4),
         InputTiles(128, 128, 8, 3)]
# tma=False: the pointer kernel (token rows gathered); the others copy them into aligned rows and load by TMA
WEIGHT = [WeightTiles(tma=False), WeightTiles(128, 256, 64, 8, 3, tma=False), WeightTiles(),
          WeightTiles(128, 128, 64, 8, 4), WeightTiles(128, 256, 64, 8, 3), WeightTiles(256, 128, 64, 8, 3),
          WeightTiles(128, 128, 32, 8, 5), WeightTiles(128, 256, 32, 8, 4), WeightTiles(128, 128, 64, 4, 3),
          WeightTiles(128, 128, 64, 8, 3, group_p=16)]
KERNELS = ("act", "input", "weight")
FIELDS = ["date", "gpu", "torch", "triton", "commit", "shape", "M", "block_m", "op", "tiles", "us"]
ROWS: list[list] = []  # (shape, M, block_m, op, tiles, µs) of every timed candidate


def _time(fn, rep_ms: float) -> float:
    try:
        return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3  # µs
    except Exception as err:  # a tile that does not compile or fit: report and go on
        print(f"      failed: {type(err).__name__}: {str(err)[:120]}")
        return float("inf")


def _best(name: str, results: list[tuple[object, float]], default: object, flops: float = 0.0,
          where: tuple = ()) -> None:
    """Print every candidate and the best beside the shipped tiles; keep the rows (``where``: shape, M, block_m)."""
    timed = dict(results)
    for tiles, us in results:
        print(f"    {us:9.1f} µs  {tiles}")
        ROWS.append([*where, name.split(" block_m")[0], repr(tiles), f"{us:.1f}"])
    tiles, us = min(results, key=lambda r: r[1])
    base = timed.get(default, float("nan"))
    rate = f" ({flops / us / 1e6:.0f} TFLOP/s)" if flops else ""
    print(f"  {name}: shipped {default} {base:.1f} µs; best {us:.1f} µs{rate} ({base / us:.2f}x) with {tiles}",
          flush=True)


def run_shape(name: str, m: int, kernels: tuple[str, ...] = KERNELS, block_ms: tuple[int, ...] = (),
              rep_ms: float = 40.0) -> None:
    """Time every candidate of ``kernels`` at the align blocks ``block_ms`` (default: the shipped one),
    each a ``do_bench`` median over ``rep_ms``."""
    e, n, k, topk = SHAPES[name]
    block_ms = block_ms or (grad_block_m(e),)
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    w1 = torch.randn(e, 2 * n, k, device=dev, dtype=dt) / k**0.5
    w2 = torch.randn(e, k, n, device=dev, dtype=dt) / n**0.5
    tw, ids = torch.topk(torch.randn(m, e, device=dev).softmax(-1), topk)
    ids = ids.to(torch.int32)
    go = torch.randn(m, k, device=dev, dtype=dt)
    print(f"{name} M={m}", flush=True)
    for block_m in block_ms:
        offsets = torch.empty(e + 1, dtype=torch.int32, device=dev)
        sorted_ids, expert_ids, npp = moe_align_block_size(ids, block_m, e, None, offsets)
        route = (topk, sorted_ids, expert_ids, npp)
        if "act" in kernels:
            act = [(t, _time(lambda t=t: moe_grad_act(go, x, w1, w2, tw, *route, activation=Activation(),
                                                       block_m=block_m, tiles=t), rep_ms))
                   for t in ACT]
            _best(f"moe_grad_act block_m={block_m}", act, act_tiles(block_m), where=(name, m, block_m))
        grad_h, inter, partial = moe_grad_act(go, x, w1, w2, tw, *route, activation=Activation(), block_m=block_m,
                                              tiles=act_tiles(block_m))
        if "input" in kernels:
            inp = [(t, _time(lambda t=t: moe_grad_input(grad_h, w1, partial, tw, ids, sorted_ids, expert_ids, npp, e,
                                                         block_m=block_m, tiles=t), rep_ms)) for t in INPUT]
            _best(f"moe_grad_input block_m={block_m}", inp, InputTiles(), where=(name, m, block_m))
        if block_m != block_ms[0] or "weight" not in kernels:
            continue  # the weight GEMMs walk each expert's rows: the align block does not matter
        dw1 = [(t, _time(lambda t=t: moe_grad_weight(grad_h, x, tw, sorted_ids, offsets, e, tokens_left=False,
                                                      scale_tokens=False, row_align=block_m, tiles=t), rep_ms))
               for t in WEIGHT]
        _best("moe_grad_weight dW1", dw1, weight_tiles(m * topk, e), 2.0 * m * topk * 2 * n * k, (name, m, block_m))
        dw2 = [(t, _time(lambda t=t: moe_grad_weight(go, inter, tw, sorted_ids, offsets, e, tokens_left=True,
                                                      scale_tokens=False, row_align=block_m, tiles=t), rep_ms))
               for t in WEIGHT]
        _best("moe_grad_weight dW2", dw2, weight_tiles(m * topk, e), 2.0 * m * topk * n * k, (name, m, block_m))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--ms", type=int, nargs="+", default=[4096])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--block-ms", type=int, nargs="*", default=[],
                        help="align blocks of moe_grad_act and moe_grad_input (default: the shipped grad_block_m)")
    parser.add_argument("--out", type=Path, default=None, help="append the rows to this CSV")
    parser.add_argument("--rep-ms", type=float, default=40.0, help="do_bench repetition time per candidate (ms)")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse --short HEAD)")
    args = parser.parse_args()
    for m in args.ms:
        for name in args.shapes:
            run_shape(name, m, tuple(args.kernels), tuple(args.block_ms), args.rep_ms)
            torch.cuda.empty_cache()
    if args.out:
        commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                               text=True).stdout.strip()
        meta = [datetime.datetime.now().isoformat(timespec="seconds"), torch.cuda.get_device_name(),
                torch.__version__, triton.__version__, commit]
        new = not args.out.exists()
        with args.out.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(FIELDS)
            writer.writerows([*meta, *row] for row in ROWS)


if __name__ == "__main__":
    main()
