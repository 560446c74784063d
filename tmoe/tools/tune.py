"""``python -m tmoe tune``: search tile configs on the GPU and write a tuned table.

For each M the two GEMMs are timed separately over a candidate list (the align block size is
shared, so the pair with the best summed time wins). fp8 (``--quant fp8_block|fp8_token``):
weights quantized as checkpoints carry them, and the up GEMM is timed together with the
intermediate's quantization (in its epilogue when the tile allows, else the quant stage).
Results are written after every M, and M values already in the output file are skipped, so
an interrupted run resumes. Weight-only low-bit (``--quant int4|int8|mxfp4``): weights as
``tmoe.tools.low_bit`` quantizes them for the bench (group 128; mxfp4 32), tiles with block_k
above and at most the group (two dequantization paths), pointer loads only; tables named
``dtype=int4_w4a16`` etc. ``--direct`` tunes the decode path's down GEMM (fused top-k
reduce) at the given M values of an existing table, adding ``direct_down`` to those rows.
``--tma`` / ``--swap`` / ``--persistent`` time the rows of an existing table at the given M
values against the TMA-weight, ``swap_ab`` or persistent (TMA) candidates of the same block_m and
keep the fastest; they can be run again (not resumable). Low-bit codes load by pointers, so
``--tma`` and ``--persistent`` are for bf16 and fp8 tables.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tmoe.tools.low_bit import GROUP_SIZE, quantize as quantize_low_bit
from tmoe.tools.peers import quantize_fp8
from tmoe.config import GemmConfig, MoEConfig, config_file_name, device_name, read_table, save_table
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.operands import Routing, Scales, WeightScales
from tmoe.kernels.moe_down_reduce import moe_down_reduce
from tmoe.kernels.moe_gemm import invoke_moe_gemm
from tmoe.kernels.quant import per_token_group_quant_fp8, per_token_quant_fp8
from tmoe.tools.tune_tiles import (
    DIRECT_DOWN_TILES, FP8_LARGE_TILES, FP8_SMALL_TILES, LARGE_TILES, LOW_BIT_LARGE_TILES, LOW_BIT_SMALL_TILES, SMALL_TILES,
)

SHAPES = {"mixtral": (8, 14336, 4096, 2), "qwen3": (128, 768, 2048, 8), "deepseek": (256, 2048, 7168, 8)}
DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUANTS = {"none": None, "fp8_block": (128, 128), "fp8_token": None}
VARIANTS = ("tma", "swap", "persistent")  # --tma / --swap / --persistent
LOW_BIT = {"int4": GROUP_SIZE, "int8": GROUP_SIZE, "mxfp4": 32}  # weight-only schemes and their group sizes
TABLE_DTYPES = {"fp8_block": "fp8_w8a8", "fp8_token": "fp8_w8a8", "int4": "int4_w4a16", "int8": "int8_w8a16",
                "mxfp4": "mxfp4_w4a16"}


def _k_cap(quant: str) -> int:
    """The largest block_k of ``quant``: its activation group (fp8 block) or weight group (low-bit)."""
    if quant in LOW_BIT:
        return LOW_BIT[quant]
    return QUANTS[quant][1] if QUANTS[quant] else 1 << 30


def block_ms(m: int, e: int, topk: int) -> list[int]:
    """The two largest block sizes that tokens-per-expert can fill (at least 16)."""
    per_expert = m * topk / e
    return [bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * per_expert)][-2:]


def candidates(block_m: int, gated: bool, quant: str = "none",
               tma: tuple[bool, ...] | None = None) -> list[GemmConfig]:
    """Tile configs to time; ``tma`` None: pointer loads, and TMA weight tiles too from block_m 64
    (on smaller tiles TMA was within 1% in the H200 retune), and for fp8 below block_m 64 the
    ``swap_ab`` pointer tiles (block_n >= 64) too: there the plain tiles compile to mma.sync with
    every fp8 weight converted to fp16 first, swap_ab ones to wgmma on fp8."""
    if quant in LOW_BIT:  # each tile, and with block_k capped at the group (one scale per K step); no TMA
        tiles = (SMALL_TILES + LOW_BIT_SMALL_TILES) if block_m <= 32 else (LARGE_TILES + LOW_BIT_LARGE_TILES)
        tiles = sorted(set(tiles) | {(bn, min(bk, LOW_BIT[quant]), w, s) for bn, bk, w, s in tiles})
        return [GemmConfig(block_m, bn, bk, 8, w, s) for bn, bk, w, s in tiles if not (gated and bn > 128)]
    if quant == "none":
        tiles = SMALL_TILES if block_m <= 32 else LARGE_TILES
    else:
        tiles = FP8_SMALL_TILES if block_m <= 32 else FP8_LARGE_TILES
    cap = _k_cap(quant)
    swap = tma is None and quant != "none" and block_m < 64
    if tma is None:
        tma = (False, True) if block_m >= 64 else (False,)
    configs = [GemmConfig(block_m, bn, bk, 8, w, s, tma=t) for t in tma
               for bn, bk, w, s in tiles if not (gated and bn > 128) and bk <= cap]
    return configs + [replace(c, swap_ab=True) for c in configs if swap and c.block_n >= 64]


def _time_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def _fastest(configs: list[GemmConfig], run) -> tuple[float, GemmConfig]:
    """(µs, config) of the fastest ``run(config)``; a config that fails (shared memory) is skipped."""
    timed = []
    for cfg in configs:
        try:
            timed.append((_time_us(lambda: run(cfg)), cfg))
        except Exception as err:  # a config that does not fit shared memory: skip it
            print(f"    skip {cfg}: {type(err).__name__}", flush=True)
    return min(timed, key=lambda t: t[0], default=(float("inf"), None))


@dataclass(frozen=True)
class Problem:
    """What one tuning shape runs: w1 (E, 2N, K) / w2 (E, K, N) in the tuned dtype (low-bit: codes),
    their scales (and zero points)."""

    w1: torch.Tensor
    w2: torch.Tensor
    topk: int
    quant: str = "none"
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w1_zp: torch.Tensor | None = None
    w2_zp: torch.Tensor | None = None

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(E, N, K, topk), whatever the weights' packing."""
        return self.w1.shape[0], self.w1.shape[1] // 2, self.w2.shape[1], self.topk

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Activations as the layer's prepare (or the between-GEMM quant stage) makes them."""
        if self.quant == "fp8_block":
            return per_token_group_quant_fp8(x, QUANTS["fp8_block"][1])
        if self.quant == "fp8_token":
            return per_token_quant_fp8(x)
        return x, None

    def scales(self, a_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
               w_zp: torch.Tensor | None = None) -> Scales | WeightScales | None:
        if self.quant in LOW_BIT:
            return WeightScales(self.quant, w_scale, w_zp, LOW_BIT[self.quant])
        return None if a_scale is None else Scales(a_scale, w_scale, QUANTS[self.quant])


def make_problem(e: int, n: int, k: int, topk: int, dtype: torch.dtype, quant: str) -> Problem:
    w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=dtype) / k**0.5
    w2 = torch.randn(e, k, n, device="cuda", dtype=dtype) / n**0.5
    if quant == "none":
        return Problem(w1, w2, topk)
    if quant in LOW_BIT:
        (q1, s1, z1), (q2, s2, z2) = quantize_low_bit(w1, quant), quantize_low_bit(w2, quant)
        return Problem(q1, q2, topk, quant, s1, s2, z1, z2)
    (w1q, s1), (w2q, s2) = quantize_fp8(w1, quant), quantize_fp8(w2, quant)
    return Problem(w1q, w2q, topk, quant, s1, s2)


def _gemm_runs(m: int, p: Problem, block_m: int):
    """(up(cfg), down(cfg)): launch the layer's two GEMMs (the up one with the intermediate's
    fp8 quantization) at ``m`` tokens of random routing, aligned to ``block_m``."""
    e, n, k, topk = p.sizes
    x, x_scale = p.quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    ids = torch.topk(torch.randn(m, e, device="cuda"), topk).indices.to(torch.int32)
    inter = torch.empty(m * topk, n, device="cuda", dtype=torch.bfloat16)
    inter_q, inter_scale = p.quantize(inter)
    group = QUANTS[p.quant][1] if QUANTS.get(p.quant) else None
    fused_scale = torch.empty(m * topk, n // group, device="cuda") if group else None
    out = torch.empty(m * topk, k, device="cuda", dtype=torch.bfloat16)
    s, eids, ntpp = moe_align_block_size(ids, block_m, e)
    up_route, down_route = Routing(s, eids, ntpp, m * topk, topk), Routing(s, eids, ntpp, m * topk, 1)

    def up(cfg: GemmConfig) -> None:
        scales = p.scales(x_scale, p.w1_scale, p.w1_zp)
        if group and cfg.block_n % group == 0 and n % group == 0:  # epilogue quantization
            invoke_moe_gemm(x, p.w1, inter_q, cfg, gated=True, routing=up_route, scales=scales,
                            out_scale=fused_scale)
        else:
            invoke_moe_gemm(x, p.w1, inter, cfg, gated=True, routing=up_route, scales=scales)
            p.quantize(inter)

    def down(cfg: GemmConfig) -> None:
        invoke_moe_gemm(inter_q, p.w2, out, cfg, gated=False, routing=down_route,
                        scales=p.scales(inter_scale, p.w2_scale, p.w2_zp))

    return up, down


def tune_m(m: int, p: Problem) -> tuple[MoEConfig, float]:
    """Best config at ``m`` tokens and its summed GEMM (+ intermediate quant) time in µs."""
    best: tuple[MoEConfig, float] | None = None
    for bm in block_ms(m, p.sizes[0], p.topk):
        up, down = _gemm_runs(m, p, bm)
        t_up, up_cfg = _fastest(candidates(bm, True, p.quant), up)
        t_down, down_cfg = _fastest(candidates(bm, False, p.quant), down)
        if best is None or t_up + t_down < best[1]:
            best = (MoEConfig(up_cfg, down_cfg), t_up + t_down)
    return best


def variant_candidates(block_m: int, gated: bool, quant: str, kind: str) -> list[GemmConfig]:
    """``kind`` ("tma", "swap", "persistent") tiles at ``block_m``: TMA weight tiles, ``swap_ab``
    pointer tiles (block_n >= 64), or persistent TMA tiles. Low-bit codes take only "swap"."""
    if kind not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {kind!r}")
    if kind == "swap":
        return [replace(c, swap_ab=True) for c in candidates(block_m, gated, quant, tma=(False,)) if c.block_n >= 64]
    if quant in LOW_BIT:
        raise ValueError(f"{quant} weights load by pointers: no {kind} tiles")
    tiles = candidates(block_m, gated, quant, tma=(True,))
    return [replace(c, persistent=True) for c in tiles] if kind == "persistent" else tiles


def tune_variant(m: int, p: Problem, row: MoEConfig, kind: str) -> tuple[MoEConfig, float]:
    """The table row at ``m`` against the ``kind`` candidates at its block_m: the fastest up and
    down configs (the row's own among them) and their summed time in µs."""
    run_up, run_down = _gemm_runs(m, p, row.block_m)
    picked, total = [], 0.0
    for name, own, run, gated in (("up", row.up, run_up, True), ("down", row.down, run_down, False)):
        t_own, _ = _fastest([own], run)
        t_new, best = _fastest(variant_candidates(own.block_m, gated, p.quant, kind), run)
        print(f"    {name}: table {t_own:.1f} us, best {kind} {t_new:.1f} us ({best})", flush=True)
        picked.append(best if t_new < t_own else own)
        total += min(t_own, t_new)
    return replace(row, up=picked[0], down=picked[1]), total


def tune_direct_down(m: int, p: Problem) -> tuple[GemmConfig, float]:
    """Best decode-path down GEMM config at ``m`` tokens and its time in µs."""
    e, n, k, topk = p.sizes
    ids = torch.topk(torch.randn(m, e, device="cuda"), topk).indices.to(torch.int32)
    weights = torch.rand(m, topk, device="cuda")
    inter_q, inter_scale = p.quantize(torch.randn(m * topk, n, device="cuda", dtype=torch.bfloat16))
    out = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    tiles, cap = DIRECT_DOWN_TILES, _k_cap(p.quant)
    if p.quant in LOW_BIT:
        tiles, cap = sorted(set(tiles) | {(bn, min(bk, cap), w, s) for bn, bk, w, s in tiles}), 1 << 30
    configs = [GemmConfig(16, bn, bk, 8, w, s) for bn, bk, w, s in tiles if bk <= cap]
    us, cfg = _fastest(configs, lambda c: moe_down_reduce(inter_q, p.w2, out, ids, e, c, topk_weights=weights,
                                                          scales=p.scales(inter_scale, p.w2_scale, p.w2_zp)))
    return cfg, us


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tmoe tune", description=__doc__)
    ap.add_argument("--shape", required=True, help=f"one of {sorted(SHAPES)} or E,N,K,topk")
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--quant", default="none", choices=sorted(QUANTS) + sorted(LOW_BIT))
    ap.add_argument("--out", default=".", metavar="DIR", help="the table's directory, read to resume (default: the "
                    "current one; TMOE_CONFIG_DIR=DIR makes tmoe use it; to ship a table: tmoe/config/tuned)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--direct", action="store_true", help="add decode-path down tiles to the table's rows")
    mode.add_argument("--tma", action="store_true", help="time the table's rows against TMA-weight tiles, keep the fastest")
    mode.add_argument("--swap", action="store_true", help="time the table's rows against swap_ab tiles, keep the fastest")
    mode.add_argument("--persistent", action="store_true", help="the same against persistent TMA tiles")
    args = ap.parse_args(argv)
    args.kind = next((kind for kind in VARIANTS if getattr(args, kind)), None)
    if args.kind:
        try:
            variant_candidates(16, True, args.quant, args.kind)  # low-bit codes have no TMA kinds
        except ValueError as err:
            ap.error(f"--{args.kind}: {err}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    kind = args.kind
    e, n, k, topk = SHAPES.get(args.shape) or tuple(int(v) for v in args.shape.split(","))
    path = Path(args.out) / config_file_name(e, n, device_name(torch.device("cuda")),
                                             TABLE_DTYPES.get(args.quant), QUANTS.get(args.quant))
    path.parent.mkdir(parents=True, exist_ok=True)
    table = read_table(path) if path.is_file() else {}
    ms = [int(v) for v in args.ms.split(",")]
    problem = make_problem(e, n, k, topk, getattr(torch, args.dtype), args.quant)
    for i, m in enumerate(ms):
        if args.direct:
            if m not in table or table[m].direct_down is not None:
                print(f"[{i + 1}/{len(ms)}] M={m}: {'no row' if m not in table else 'already tuned'}", flush=True)
                continue
            cfg, us = tune_direct_down(m, problem)
            table[m] = replace(table[m], direct_down=cfg)
            save_table(path, table)
            print(f"[{i + 1}/{len(ms)}] M={m}: direct down {us:.1f} us {cfg}", flush=True)
            continue
        if kind:
            if m not in table:
                print(f"[{i + 1}/{len(ms)}] M={m}: no row", flush=True)
                continue
            table[m], us = tune_variant(m, problem, table[m], kind)
            save_table(path, table)
            print(f"[{i + 1}/{len(ms)}] M={m}: {us:.1f} us  up={table[m].up} down={table[m].down}", flush=True)
            continue
        if m in table:
            print(f"[{i + 1}/{len(ms)}] M={m}: already tuned", flush=True)
            continue
        t0 = time.time()
        cfg, us = tune_m(m, problem)
        table[m] = cfg
        save_table(path, table)
        print(f"[{i + 1}/{len(ms)}] M={m}: {us:.1f} us  up={cfg.up} down={cfg.down} ({time.time() - t0:.0f} s)",
              flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
