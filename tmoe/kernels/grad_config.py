"""Tile configurations of the backward GEMMs: frozen values the backward launchers take (the rules
that pick them live in ``tmoe.config.backward``)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar


@dataclass(frozen=True)
class ActTiles:
    """Tiles of ``moe_grad_act``: BLOCK_N intermediate columns, BLOCK_K steps (rows: the align block);
    ``tma``: take the TMA path where the operands allow it (``tma_operands_fit``); ``g_first``:
    compute g = go @ w2 first, as its own GEMM (``tmoe.kernels.moe_grad_act``'s docstring)."""

    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True
    g_first: bool = False


@dataclass(frozen=True)
class InputTiles:
    """Tiles of ``moe_grad_input``: BLOCK_N columns of K, BLOCK_R steps over w1's rows; ``tma``: load
    dh and w1 by TMA where they allow it."""

    block_n: int = 256
    block_r: int = 64
    num_warps: int = 8
    num_stages: int = 4
    tma: bool = True

    LOW_BIT_BLOCK_N: ClassVar[int] = 128

    def for_low_bit(self) -> InputTiles:
        """The tiles with frozen low-bit weights, whose codes are gathered and dequantized per element
        in registers: at most ``LOW_BIT_BLOCK_N`` columns (Triton 3.9's sm_90 build of the 256-column
        tile with a LoRA term spilled 144-232 bytes of stack)."""
        return replace(self, block_n=min(self.block_n, self.LOW_BIT_BLOCK_N))


@dataclass(frozen=True)
class WeightTiles:
    """Tiles of ``moe_grad_weight``: a BLOCK_P x BLOCK_Q output tile, BLOCK_R rows a step; within an
    expert, ``group_p`` output row blocks sweep the column blocks together (grouped order). ``tma``:
    copy the token operand into aligned-row order and load both operands by TMA where they fit
    (``sorted_operands_fit``); else gather the token rows by pointers."""

    block_p: int = 128
    block_q: int = 128
    block_r: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_p: int = 8
    tma: bool = True
