"""Batch invariance: the switch (``tmoe.batch_invariant()``, ``TMOE_BATCH_INVARIANT``) and the
tiles it pins, so that a token's output row is the same bits whatever batch it is in.

A token's bits depend on the order its sums are taken in. The GEMMs accumulate K in ascending order
into one float32 accumulator whatever the tile (no split-K), the top-k reduce sums the slots in slot
order, the router and the activation quantization work per row: what can still change with M is a
tile choice that changes rounding (block_k where a K tile's dot is rescaled before it is added:
block-scaled fp8; the fused decode kernel's intermediate blocks, whose partial sums it adds), whether
block fp8's up GEMM quantizes the intermediate in its epilogue (from float32) or a separate stage
does (from the activation dtype), and routes that sum the top-k slots in another order (fused,
direct). Under the mode those are pinned: see ``docs/numerics.md``."""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import replace
from typing import Iterator

from tmoe.kernels.gemm_config import MoEConfig

_STACK: list[bool] = []
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Run every tmoe layer call inside the block batch-invariantly (``enabled=False``: not, whatever
    ``TMOE_BATCH_INVARIANT`` says). A layer's own ``batch_invariant=`` argument, when given, wins.
    Read inside the layer op at each call: enter it outside a ``torch.compile``d function.

    Example:
        >>> with tmoe.batch_invariant():
        ...     out = tmoe.fused_experts(x, w1, w2, weights, ids)  # row i: the same bits at any M
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"batch_invariant(enabled) must be a bool, got {enabled!r}")
    _STACK.append(enabled)
    try:
        yield
    finally:
        _STACK.pop()


@functools.lru_cache(maxsize=None)
def _env_flag(raw: str | None) -> bool:
    value = (raw or "").strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"TMOE_BATCH_INVARIANT must be 1 or 0 (true/false, on/off), got {raw!r}")


def batch_invariant_requested() -> bool:
    """The innermost ``batch_invariant()`` block's setting, else ``TMOE_BATCH_INVARIANT`` (default off)."""
    if _STACK:
        return _STACK[-1]
    return _env_flag(os.environ.get("TMOE_BATCH_INVARIANT"))


def resolve_batch_invariant(flag: bool | None) -> bool:
    """A layer's ``batch_invariant`` argument (None: the context, then the environment) as the mode."""
    return batch_invariant_requested() if flag is None else flag


def invariant_block_k(block_shape: tuple[int, int] | None, fp8: bool, group_size: int | None, k: int,
                      n: int) -> tuple[int, int]:
    """The (up, down) block_k the mode runs at every M: block-scaled fp8 one scale group (at most
    128), other fp8 128, low-bit weights 64 halved until it divides the GEMM's K, floats 64. Each is
    at most the heuristic's largest at that dtype, so no pinned tile needs more shared memory than a
    tile the tables or the heuristic already run."""
    if block_shape is not None and fp8:
        bk = min(128, block_shape[1])
        return bk, bk
    if fp8:
        return 128, 128
    if group_size is not None:
        return next((b for b in (64, 32) if k % b == 0), 64), next((b for b in (64, 32) if n % b == 0), 64)
    return 64, 64


def pin_block_k(cfg: MoEConfig, up_bk: int, down_bk: int) -> MoEConfig:
    """``cfg`` with its GEMMs' block_k pinned (the decode path's down GEMM takes the down one)."""
    direct = None if cfg.direct_down is None else replace(cfg.direct_down, block_k=down_bk)
    return MoEConfig(replace(cfg.up, block_k=up_bk), replace(cfg.down, block_k=down_bk), direct)


FP8_BLOCK_M = 64  # the mode's one tile height for fp8 GEMMs


def pin_fp8_block_m(cfg: MoEConfig) -> MoEConfig:
    """``cfg`` with its GEMMs' block_m pinned to ``FP8_BLOCK_M``: on Hopper an fp8 dot of a 16-row
    tile compiles to other MMA instructions than one of 64 rows or more, whose fp8 accumulation
    differs (measured on an H100: the mode's fp8 rows at M = 256 differed from M <= 64, where the
    tiles were 16 rows high; with the pin they hold at M up to 4096, and block fp8 costs 2.1-2.9x at
    decode: docs/numerics.md)."""
    return MoEConfig(replace(cfg.up, block_m=FP8_BLOCK_M), replace(cfg.down, block_m=FP8_BLOCK_M), cfg.direct_down)
