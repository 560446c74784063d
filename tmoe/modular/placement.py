"""Which rank holds which expert, and a rank's share of the expert weights.

Two placements of ``E`` experts over ``W`` ranks, ``E % W == 0``, ``E_local = E / W`` each:
``contiguous`` (rank r holds experts r*E_local .. (r+1)*E_local - 1, local id e - r*E_local) and
``round_robin`` (rank r holds experts r, r+W, r+2W, ..., local id e // W).
"""
from __future__ import annotations

import torch

from tmoe.kernels.checks import positive_int

PLACEMENTS = ("contiguous", "round_robin")


def check_placement(placement: str, num_experts: int, world_size: int) -> int:
    """Raise unless ``placement`` is known and spreads ``num_experts`` evenly; returns E_local."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    e, w = positive_int("num_experts", num_experts), positive_int("world_size", world_size)
    if e % w:
        raise ValueError(f"num_experts={e} must be a multiple of the world size {w} (every rank holds as many experts)")
    return e // w


def owner_and_local(experts: torch.Tensor, num_experts: int, world_size: int, placement: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, local id) of each global expert id in ``experts`` (any int tensor), elementwise."""
    e_local = check_placement(placement, num_experts, world_size)
    if placement == "contiguous":
        return experts // e_local, experts % e_local
    return experts % world_size, experts // world_size


def local_expert_ids(num_experts: int, world_size: int, rank: int, placement: str = "contiguous") -> torch.Tensor:
    """(E_local,) int64: the global ids rank ``rank`` holds, in local-id order."""
    e_local = check_placement(placement, num_experts, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    local = torch.arange(e_local)
    return rank * e_local + local if placement == "contiguous" else local * world_size + rank


def expert_map(num_experts: int, world_size: int, rank: int, placement: str = "contiguous",
               device: torch.device | str | None = None) -> torch.Tensor:
    """(E,) int32 ``expert_map`` of rank ``rank``: global id -> local id, -1 for other ranks' experts.

    Example: ``expert_map(8, 2, 1, "round_robin")`` -> [-1, 0, -1, 1, -1, 2, -1, 3].
    """
    out = torch.full((num_experts,), -1, dtype=torch.int32)
    ids = local_expert_ids(num_experts, world_size, rank, placement)
    out[ids] = torch.arange(ids.numel(), dtype=torch.int32)
    return out.to(device)


def shard_experts(t: torch.Tensor | None, world_size: int, rank: int, placement: str = "contiguous"
                  ) -> torch.Tensor | None:
    """Rank ``rank``'s experts of a per-expert tensor (dim 0 = E: w1, w2, their scales, biases),
    contiguous, in local-id order; None stays None. A per-tensor scale of one element (not
    per expert) is returned as it is."""
    if t is None or t.dim() == 0 or (t.numel() == 1 and t.shape[0] == 1):
        return t
    ids = local_expert_ids(t.shape[0], world_size, rank, placement).to(t.device)
    return t.index_select(0, ids).contiguous()


def send_buffer_map(num_experts: int, world_size: int, placement: str, device: torch.device) -> torch.Tensor | None:
    """(E,) int32: the send-buffer index rank * E_local + local id of each global expert (buffers
    destination-rank major, as ``all_to_all_single`` splits them); None for contiguous (identity)."""
    if placement == "contiguous":
        check_placement(placement, num_experts, world_size)
        return None
    rank, local = owner_and_local(torch.arange(num_experts, device=device), num_experts, world_size, placement)
    return (rank * (num_experts // world_size) + local).to(torch.int32)
