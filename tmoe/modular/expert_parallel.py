"""``ExpertParallel``: how a layer spreads its experts over a process group, as one value that
builds the layer's PrepareAndFinalize and experts, its ``expert_map`` and its weight shards."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from tmoe.kernels.checks import positive_int
from tmoe.modular.alltoall import AllToAllPrepareAndFinalize
from tmoe.modular.distributed import AllGatherPrepareAndFinalize, group_name_of
from tmoe.modular.experts import BatchedTritonExperts, TritonExperts
from tmoe.modular.interfaces import FusedMoEPermuteExpertsUnpermute, FusedMoEPrepareAndFinalize
from tmoe.modular.placement import PLACEMENTS, check_placement, expert_map, shard_experts
from tmoe.modular.quant_config import FusedMoEQuantConfig

MODES = ("alltoall", "allgather")


@dataclass(frozen=True)
class ExpertParallel:
    """Experts spread over ``group`` (a ProcessGroup or its name; None: the default group).

    placement: "contiguous" or "round_robin". mode: "alltoall" (``AllToAllPrepareAndFinalize``
    + ``BatchedTritonExperts``; needs ``max_tokens_per_rank``, ``capacity`` per (rank, expert)
    defaults to it) or "allgather" (``AllGatherPrepareAndFinalize`` + ``TritonExperts``; every
    rank passes the same token count). The group is kept by name, so the value copies and pickles.

    Example::

        ep = tmoe.ExpertParallel(max_tokens_per_rank=256, placement="round_robin")
        layer = tmoe.FusedMoE(64, 1024, 512, topk=4, expert_parallel=ep)  # holds 64 / W experts
    """

    group: dist.ProcessGroup | str | None = None
    placement: str = "contiguous"
    mode: str = "alltoall"
    max_tokens_per_rank: int = 0
    capacity: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.mode == "alltoall":
            positive_int("max_tokens_per_rank", self.max_tokens_per_rank)
        object.__setattr__(self, "group", group_name_of(self.group))

    @property
    def world_size(self) -> int:
        return dist.get_world_size(_resolve_process_group(self.group))

    @property
    def rank(self) -> int:
        return dist.get_rank(_resolve_process_group(self.group))

    def num_local_experts(self, num_experts: int) -> int:
        return check_placement(self.placement, num_experts, self.world_size)

    def expert_map(self, num_experts: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(E,) int32: this rank's local id of each global expert, -1 for the other ranks'."""
        return expert_map(num_experts, self.world_size, self.rank, self.placement, device)

    def shard(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's experts of a per-expert tensor (dim 0 = E): weights, scales, biases."""
        return shard_experts(t, self.world_size, self.rank, self.placement)

    def kernel_parts(self, num_experts: int, quant_config: FusedMoEQuantConfig | None = None
                     ) -> tuple[FusedMoEPrepareAndFinalize, FusedMoEPermuteExpertsUnpermute]:
        """The (PrepareAndFinalize, experts) pair of ``mode`` for ``num_experts`` global experts."""
        if self.mode == "allgather":
            self.num_local_experts(num_experts)
            return AllGatherPrepareAndFinalize(self.group), TritonExperts(quant_config)
        pf = AllToAllPrepareAndFinalize(self.group, self.max_tokens_per_rank, num_experts, self.capacity,
                                        self.placement)
        return pf, BatchedTritonExperts(pf.expert_capacity, quant_config)
