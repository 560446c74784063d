"""Tile rules of the backward stages, beside the forward's (``tmoe.config``): the align block from
the expert count, each backward GEMM's tiles from static sizes, and a scoped override for tests.

The backward ops (``tmoe.ops.backward``) call these inside their bodies and fakes; the kernels'
launchers take the chosen tiles as arguments."""
from __future__ import annotations

import contextlib
from typing import Iterator

from tmoe.kernels.grad_config import ActTiles, InputTiles, WeightTiles
from tmoe.kernels.sizes import cdiv

_OVERRIDE: list[dict] = []


@contextlib.contextmanager
def override_backward_tiles(*, act: ActTiles | None = None, input: InputTiles | None = None,
                            weight: WeightTiles | None = None) -> Iterator[None]:
    """Force the tiles of ``moe_grad_act`` (``act``), ``moe_grad_input`` (``input``) and
    ``moe_grad_weight`` (``weight``) inside the block (tests, sweeps); None keeps the rule's."""
    _OVERRIDE.append(dict(act=act, input=input, weight=weight))
    try:
        yield
    finally:
        _OVERRIDE.pop()


def _forced(stage: str):
    return _OVERRIDE[-1][stage] if _OVERRIDE else None


def grad_block_m(num_experts: int) -> int:
    """The backward's align block (rows of one expert per program), from the expert count alone:
    128 for a few large experts (Mixtral's 8: the dX GEMM 1.4x faster), else 64 (H100 tile sweep,
    ``bench/repro_grad_tiles.py``)."""
    return 128 if num_experts <= 16 else 64


def act_tiles(block_m: int) -> ActTiles:
    """``moe_grad_act``'s tiles at an align block (the sweeps' best at each, ``bench/repro_grad_tiles.py``,
    H100): at 128 rows g_first on TMA (g's GEMM first, then 128-column tiles of the recomputed
    pre-activation): 1.08x over the fused TMA kernel at Mixtral-8x7B M = 4096, 1.13x at M = 16384,
    where the fused kernel's three [128, 128] accumulators spilled registers; at 64 rows the
    fused kernel on gathered rows stays, faster than TMA plus the aligned copies of grad_out and x
    (1.13x DeepSeek-V3 M = 4096, 1.19x Qwen3-30B-A3B M = 16384) and than g_first (1.02x, 1.16x)."""
    forced = _forced("act")
    if forced is not None:
        return forced
    return ActTiles(128, 64, 8, 3, g_first=True) if block_m >= 128 else ActTiles(tma=False)


def grad_act_blocks(n: int, block_m: int) -> int:
    """Column blocks of ``moe_grad_act``'s ``partial`` output (one float32 per aligned row and block)."""
    return cdiv(n, act_tiles(block_m).block_n)


SHALLOW_PIPELINE_TOKENS = 1024


def input_tiles(num_tokens: int) -> InputTiles:
    """``moe_grad_input``'s tiles for a call of ``num_tokens`` tokens: 3 pipeline stages up to
    ``SHALLOW_PIPELINE_TOKENS``, 4 beyond. H100, bf16, the persistent kernel: 3 stages are 1.01-1.15x
    faster at M = 256-1024 (Mixtral-8x7B 1.24 → 1.08 ms at 1024), 4 stages 1.07-1.14x at M = 4096
    on Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3; M = 2048 splits by shape."""
    forced = _forced("input")
    if forced is not None:
        return forced
    return InputTiles(num_stages=3 if num_tokens <= SHALLOW_PIPELINE_TOKENS else 4)


def weight_tiles(num_slots: int, num_experts: int) -> WeightTiles:
    """``moe_grad_weight``'s tiles from the mean rows per expert (H100 sweep, ``bench/repro_grad_tiles.py``):
    128 x 256 output tiles where each expert sums at least 512 rows (Mixtral-8x7B M = 16384: dW1
    1.24x, dW2 1.32x over 128 x 128), 128 x 128 below (DeepSeek-V3 M = 4096, 128 rows: 1.15x more
    tiles in flight)."""
    forced = _forced("weight")
    if forced is not None:
        return forced
    return WeightTiles(block_q=256) if num_slots >= 512 * num_experts else WeightTiles()
