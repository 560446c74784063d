"""Tile configurations: a frozen dataclass, a deterministic heuristic, tuned JSON tables, a test override.

Lookup runs inside custom-op implementations (never in code that dynamo traces), keyed by
static sizes only, so it cannot cause graph breaks or recompiles.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from tmoe.config.backward import override_backward_tiles
from tmoe.config.invariant import (
    batch_invariant, batch_invariant_requested, invariant_block_k, pin_block_k, pin_fp8_block_m, resolve_batch_invariant,
)
from tmoe.config.tables import SHIPPED_CONFIGS, config_file_name, load_table, read_table, save_table
from tmoe.kernels.route import Route
from tmoe.kernels.sizes import cdiv
from tmoe.runtime.device import sm_count
from tmoe.kernels.gemm_config import GemmConfig, MoEConfig
from tmoe.runtime.pdl import override_pdl, pdl_requested


def _sms(device: torch.device) -> int:
    """The SM count the tile rules fill: the device's, 1 off a GPU (the interpreter)."""
    return sm_count(device) if device.type == "cuda" else 1


def _dividing_block_k(bk: int, k: int) -> int:
    """The largest of bk, bk / 2, ..., 32 that divides k; bk when none does."""
    return next((b for b in (bk, bk // 2, bk // 4) if b >= 32 and k % b == 0), bk)


def _filling_block_n(bn: int, rows: int, cols: int, sms: int) -> int:
    """bn halved (down to 32) until ``rows`` row blocks of ``cols`` columns make 2 * ``sms`` programs."""
    while bn > 32 and rows * cdiv(cols, bn) < 2 * sms:
        bn //= 2
    return bn


def _heuristic(m: int, e: int, n: int, k: int, topk: int, block_k_cap: int | None,
               group_size: int | None = None, sms: int = 1) -> MoEConfig:
    tokens_per_expert = m * topk / max(e, 1)
    if tokens_per_expert <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif tokens_per_expert <= 48:
        bm, bn, bk, warps, stages = 32, 64, 128, 4, 4
    elif tokens_per_expert <= 128:
        bm, bn, bk, warps, stages = 64, 64, 64, 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    up_bn = bn
    if block_k_cap is not None:
        # block scales: one K tile per scale group, and a narrower up tile, because the
        # per-tile rescale keeps a second [BM, 2BN] fp32 accumulator live (register spills)
        # (decode tiles are small enough to take block_n = 128: the epilogue then quantizes the
        # intermediate per 1 x 128 group and the bf16 intermediate is never written)
        bk, stages = min(128, block_k_cap), 3
        up_bn = 128 if bm <= 32 else min(bn, 64)
    # TMA weight tiles where they measured faster: block-fp8 GEMMs from block_m 64, the down GEMM from 128
    up_tma = block_k_cap is not None and bm >= 64
    down_tma = up_tma or bm >= 128
    up_bk = down_bk = bk
    if group_size is not None:
        # weight-only low-bit: pointer loads (the kernel unpacks bytes); block_k as above whatever the
        # group (K steps over several groups are faster), halved until it divides the GEMM's K: a K
        # tail masks every code load along K, the tile's contiguous dimension (docs/low_bit.md)
        up_tma = down_tma = False
        up_bk, down_bk = _dividing_block_k(bk, k), _dividing_block_k(bk, n)
    down_bn = min(2 * bn, 128) if bm <= 32 else bn
    if group_size is not None and bm == 16:
        # decode: narrower columns until the row blocks (slots, or touched experts) fill the GPU twice
        rows = min(m * topk, e)
        up_bn, down_bn = _filling_block_n(up_bn, rows, n, sms), _filling_block_n(down_bn, rows, k, sms)
    up = GemmConfig(bm, up_bn, up_bk, num_warps=warps, num_stages=stages, tma=up_tma)
    down = GemmConfig(bm, down_bn, down_bk, num_warps=warps, num_stages=stages, tma=down_tma)
    return MoEConfig(up, down)


_OVERRIDE: list[MoEConfig] = []


@contextlib.contextmanager
def override_config(config: MoEConfig) -> Iterator[None]:
    """Force ``config`` for every MoE GEMM launched inside the block (tests, tuning)."""
    _OVERRIDE.append(config)
    try:
        yield
    finally:
        _OVERRIDE.pop()


@functools.lru_cache(maxsize=None)
def _cuda_device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    return _cuda_device_name(device.index) if device.type == "cuda" else "cpu"


@functools.lru_cache(maxsize=4096)
def _lookup(m: int, e: int, n: int, k: int, topk: int, device: str, quant: str | None,
            block_shape: tuple[int, int] | None, config_dir: str | None, group_size: int | None = None,
            sms: int = 1) -> MoEConfig:
    dirs = (Path(config_dir), SHIPPED_CONFIGS) if config_dir else (SHIPPED_CONFIGS,)
    table = load_table(config_file_name(e, n, device, quant, block_shape), dirs)
    block_k_cap = block_shape[1] if block_shape else None
    if table and m <= 2 * max(table):  # a table tuned up to M_max serves M <= 2 M_max (beyond: the heuristic)
        cfg = table[min(table, key=lambda tm: abs(tm - m))]
        if block_k_cap is None or (cfg.up.block_k <= block_k_cap and cfg.down.block_k <= block_k_cap):
            return cfg
    return _heuristic(m, e, n, k, topk, block_k_cap, group_size, sms)


# M * topk at or below which a Standard-format layer takes the direct route (no align stage, one
# row block per slot, the down GEMM sums each token's slots). 0: opt-in through
# override_route("direct"), because its down GEMM streams weights slower (docs/routes.md).
DIRECT_MAX_SLOTS = 0
# Tokens at or below which the aligned path skips its align stage ("slots": one row block per
# slot in both GEMMs, each slot's output written, the top-k reduce as on the aligned path): it
# saves the align launch at M=1 and loses on some shapes from M=4 (docs/routes.md).
SLOT_ROUTE_MAX_TOKENS = 1
# Tokens (an inclusive range) and expert sizes (N * K at most) at which a layer with unquantized
# activations and weights takes the fused decode path (both GEMMs per slot in one kernel, then a
# reduce of the partial sums: ``moe_fused_decode``): small experts at M = 2-4 win, larger ones and
# low-bit weights lose, so it is opt-in there (docs/routes.md).
FUSED_TOKENS = (2, 4)
FUSED_MAX_EXPERT_ELEMENTS = 4 * 1024 * 1024
# An aligned layer call runs its GEMMs on the grouped core (``moe_grouped_gemm``: expert-sorted rows,
# both operands by TMA) instead of gathering rows by pointers from this many routed rows per local
# expert (M * topk / E) and this intermediate size N, unless its fp8 activations have block scales
# (docs/routes.md: copying the rows into sorted order costs about 160 / N of the GEMMs' time, so
# N = 768 loses; the block-scale GEMMs measured slower on the core). Read when a call signature is
# first planned: after changing them, ``tmoe.runtime.state.clear_launch_caches()``.
GROUPED_MIN_ROWS_PER_EXPERT = 128
GROUPED_MIN_N = 1024
# the Standard-format routes a call can be forced onto (BATCHED is the format of its own experts)
ROUTES = tuple(r.label for r in (Route.SORTED, Route.DIRECT, Route.SLOTS, Route.FUSED, Route.GROUPED))

_ROUTE_OVERRIDE: list[Route] = []


@contextlib.contextmanager
def override_route(route: str | Route) -> Iterator[None]:
    """Force a Standard-format path for every layer call inside the block (tests, benchmarks):
    "sorted" (align, then the GEMMs over expert-sorted row blocks), "direct" (the decode path:
    no align, one row block per slot, the down GEMM sums each token's slots) or "slots" (no
    align, one row block per slot in both GEMMs, then the top-k reduce) or "fused" (both GEMMs per
    (slot, block of the intermediate) in one kernel, then a reduce; layers with fp8 activations,
    which it does not run, take "sorted") or "grouped" (align, copy the rows into expert-sorted
    order, both GEMMs on the grouped core; layers whose operands it cannot read take "sorted").
    The string is the ``Route``'s label; a ``Route`` is taken as it is."""
    forced = route if isinstance(route, Route) else Route.of(route) if route in ROUTES else None
    if forced is None or forced.label not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    _ROUTE_OVERRIDE.append(forced)
    try:
        yield
    finally:
        _ROUTE_OVERRIDE.pop()


def config_state() -> tuple:
    """Everything beside the static sizes that a config, route or launch lookup reads: the active
    overrides, ``TMOE_CONFIG_DIR``, the PDL switch and the batch-invariant mode (callers that cache
    per call signature key on it too)."""
    return (tuple(_OVERRIDE), tuple(_ROUTE_OVERRIDE), os.environ.get("TMOE_CONFIG_DIR"), pdl_requested(),
            batch_invariant_requested())


def route_forced() -> bool:
    """Whether ``override_route`` forces the route of the calls now."""
    return bool(_ROUTE_OVERRIDE)


def use_direct_route(m: int, topk: int) -> bool:
    """Whether a layer call of ``m`` tokens takes the decode path."""
    if _ROUTE_OVERRIDE:
        return _ROUTE_OVERRIDE[-1] is Route.DIRECT
    return m * topk <= DIRECT_MAX_SLOTS


def use_slot_route(m: int) -> bool:
    """Whether a layer call of ``m`` tokens that does not take the decode path skips the align
    stage (one row block per slot in both GEMMs)."""
    if _ROUTE_OVERRIDE:
        return _ROUTE_OVERRIDE[-1] is Route.SLOTS
    return 0 < m <= SLOT_ROUTE_MAX_TOKENS


def use_fused_route(m: int, n: int, k: int, low_bit: bool = False) -> bool:
    """Whether a layer call of ``m`` tokens with unquantized activations, intermediate size ``n`` and
    hidden size ``k`` (``low_bit``: low-bit weights) takes the fused decode path."""
    if _ROUTE_OVERRIDE:
        return _ROUTE_OVERRIDE[-1] is Route.FUSED
    return not low_bit and FUSED_TOKENS[0] <= m <= FUSED_TOKENS[1] and n * k <= FUSED_MAX_EXPERT_ELEMENTS


def use_grouped_route(m: int, topk: int, num_local_experts: int, n: int, block_scales: bool) -> bool:
    """Whether an aligned layer call of ``m`` tokens and intermediate size ``n`` runs its GEMMs on the
    grouped core (where its operands allow: ``TritonExperts``); ``block_scales``: fp8 activations
    with block scales, which keep the aligned route."""
    if _ROUTE_OVERRIDE:
        return _ROUTE_OVERRIDE[-1] is Route.GROUPED
    return (not block_scales and n >= GROUPED_MIN_N
            and m * topk >= GROUPED_MIN_ROWS_PER_EXPERT * max(num_local_experts, 1))


def grouped_config(block_shape: tuple[int, int] | None = None, fp8: bool = False) -> MoEConfig:
    """Tiles of the grouped core, as measured fastest on H100 at M = 1024-16384 (Mixtral, Qwen3,
    DeepSeek-V3 shapes): block_m 128 (64 was slower everywhere, though DeepSeek-V3 at M=4096 then
    pads 1.43x fewer rows), the up GEMM two 128 x 128 tiles (gate, up) with 8 warps and 3 stages,
    the down GEMM 128 x 256 with 8 warps and 3 stages, block_k 64; ``fp8`` operands 128 (the same
    bytes per K step; 64 made per-token fp8 Mixtral 1.27x slower), block scales the group, at most
    128. Under ``override_config``: the forced tiles, made persistent and TMA."""
    if _OVERRIDE:
        forced = _OVERRIDE[-1]
        return MoEConfig(*(replace(g, tma=True, persistent=True, swap_ab=False) for g in (forced.up, forced.down)))
    bk = min(128, block_shape[1]) if block_shape else 128 if fp8 else 64
    return MoEConfig(GemmConfig(128, 128, bk, num_warps=8, num_stages=3, tma=True, persistent=True),
                     GemmConfig(128, 256, bk, num_warps=8, num_stages=3, tma=True, persistent=True))


def fused_decode_config(m: int, n: int, k: int, topk: int, device: torch.device,
                        batch_invariant: bool = False) -> GemmConfig:
    """Tiles of the fused decode kernel: the widest block_n of intermediate columns (128, 64, 32;
    at least 32: a 4-bit down step splits it into even and odd halves of 16) that still gives one
    program per SM (one program per slot and block), K steps of 128. ``batch_invariant``: the
    block_n of one token at every M (the down GEMM adds one partial sum per block of intermediate
    columns, so block_n sets the rounding). Under ``override_config``: the forced up GEMM's block_n
    (at least 32), block_k, warps and stages."""
    if _OVERRIDE:
        up = _OVERRIDE[-1].up
        return GemmConfig(16, max(32, up.block_n), up.block_k, num_warps=up.num_warps, num_stages=up.num_stages)
    slots = topk if batch_invariant else m * topk
    bn = next((b for b in (128, 64) if slots * cdiv(n, b) >= _sms(device)), 32)
    return GemmConfig(16, bn, 128, num_warps=4, num_stages=4)


def direct_down_config(cfg: MoEConfig, m: int, k: int, device: torch.device,
                       block_shape: tuple[int, int] | None = None) -> GemmConfig:
    """Tiles of the decode path's down GEMM (output (m, k)): the table's ``direct_down``, else
    the widest block_n that still gives two programs per SM (one program per token and block)."""
    if cfg.direct_down is not None:
        return cfg.direct_down
    bn = next((b for b in (64, 32) if m * cdiv(k, b) >= 2 * _sms(device)), 16)
    bk = min(128, block_shape[1]) if block_shape else 128
    return GemmConfig(16, bn, bk, num_warps=4, num_stages=4)


def get_config(
    m: int, e: int, n: int, k: int, topk: int, device: torch.device, quant: str | None = None,
    block_shape: tuple[int, int] | None = None, group_size: int | None = None, batch_invariant: bool = False,
) -> MoEConfig:
    """The tile config for a layer of ``e`` experts, ``w1 (e, 2n, k)``, at ``m`` tokens.

    Order: ``override_config`` > tuned table (nearest M; ``TMOE_CONFIG_DIR`` first, then the
    shipped tables) > heuristic. ``quant`` names the table's dtype suffix (``fp8_w8a8``,
    ``int4_w4a16``, ``int8_w8a16``, ``mxfp4_w4a16``); ``block_shape`` (block quantization) names
    the table too and caps block_k at the group; ``group_size`` (low-bit weights) turns the
    heuristic's TMA off (any block_k runs, over one group or several: ``dequant.dequant_dot``).
    ``batch_invariant``: block_k pinned to one value per GEMM and scheme at every M
    (``invariant_block_k``), and fp8 GEMMs' block_m too (``pin_fp8_block_m``). Lookups are cached per key.
    """
    if _OVERRIDE:
        return _OVERRIDE[-1]
    bs = tuple(block_shape) if block_shape else None
    cfg = _lookup(m, e, n, k, topk, device_name(device), quant, bs, os.environ.get("TMOE_CONFIG_DIR"), group_size,
                  _sms(device))
    if batch_invariant:
        fp8 = quant is not None and quant.startswith("fp8")
        cfg = pin_block_k(cfg, *invariant_block_k(bs, fp8, group_size, k, n))
        if fp8:
            cfg = pin_fp8_block_m(cfg)
    return cfg


__all__ = ["GemmConfig", "MoEConfig", "batch_invariant", "batch_invariant_requested", "config_file_name",
           "config_state", "resolve_batch_invariant", "route_forced", "direct_down_config", "get_config",
           "grouped_config", "override_backward_tiles", "override_config", "override_pdl", "override_route", "read_table", "save_table",
           "use_direct_route", "use_fused_route", "use_grouped_route", "fused_decode_config"]
