"""Tile configurations of the expert GEMMs: frozen values the launchers take."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of one grouped GEMM. For the up/gate GEMM ``block_n`` counts output columns of
    the activated intermediate (the kernel loads 2 * block_n weight rows). ``tma``: load the
    weight tiles with TMA (a tensor descriptor; pointer loads where TMA cannot address them).
    ``swap_ab``: pointer path only (with ``tma`` the launcher loads by pointers): compute each tile
    transposed, W_tile [BN, BK] @ A_tile^T -> [BN, BM], the weights as the MMA's LHS (its M is then
    block_n, so small block_m still gets Hopper's wgmma, and dequantized low-bit weights can stay in
    registers), transposed once at the end. The decode path's down GEMM (``moe_down_reduce``)
    ignores it. ``persistent`` (needs ``tma``): at most one program per SM, each looping over output tiles,
    where the GEMM has aligned rows (the align stage's) and TMA weights; else one program per tile."""

    PLAN_AS_VALUE: ClassVar[bool] = True  # a planned launcher keys on it whole (runtime/plan.py)

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False
    swap_ab: bool = False
    persistent: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {v}")
        if self.swap_ab and self.block_n < 64:
            raise ValueError(f"GemmConfig.swap_ab needs block_n >= 64 (the MMA's M), got {self.block_n}")
        if self.persistent and not self.tma:
            raise ValueError("GemmConfig.persistent needs tma=True (the persistent loop reads TMA weight tiles)")


@dataclass(frozen=True)
class MoEConfig:
    """Tiles for the two GEMMs; they share ``block_m``, the alignment block size.
    ``direct_down``: tiles of the decode path's down GEMM with the fused top-k reduce (its up
    GEMM takes ``up`` with block_m 16); None means the heuristic's."""

    up: GemmConfig
    down: GemmConfig
    direct_down: GemmConfig | None = None

    def __post_init__(self) -> None:
        if self.up.block_m != self.down.block_m:
            raise ValueError("MoEConfig: up and down GEMMs must share block_m (the align block size)")

    @property
    def block_m(self) -> int:
        return self.up.block_m
