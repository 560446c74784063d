"""Expert parallelism over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

``AllGatherPrepareAndFinalize``: every rank all-gathers the tokens and routing of all ranks,
runs its local experts on them (``expert_map`` marks the others remote, so their slots
contribute exactly zero), and the partial outputs are summed back to the ranks that own the
tokens (reduce-scatter). Every rank passes the same number of tokens (pad to a common count);
shapes stay static, so with NCCL the collectives capture in CUDA graphs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from tmoe.kernels.reduce import moe_reduce
from tmoe.modular.interfaces import FusedMoEActivationFormat, FusedMoEPrepareAndFinalize, PrepareResult
from tmoe.modular.quantize import quantize_activations


def group_name_of(group: dist.ProcessGroup | str | None) -> str:
    """A process group's name (None: the default group): the by-value form layer ops carry."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("expert parallelism needs a process group: call torch.distributed.init_process_group() "
                               "first, or pass group=")
        group = dist.group.WORLD
    return group if isinstance(group, str) else group.group_name


class NamedGroup:
    """A process group kept by name, as torch.distributed's functional collectives keep it, so
    the PrepareAndFinalize holding it stays a value (copies, pickles and traces by that name)."""

    _group_name: str

    @property
    def group(self) -> dist.ProcessGroup:
        return _resolve_process_group(self._group_name)

    def group_name(self) -> str:
        return self._group_name


def all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """(world * n, ...) = the ranks' (n, ...) tensors stacked in rank order."""
    world = dist.get_world_size(group)
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.chunk(world)), t.contiguous(), group=group)
    return out


def reduce_scatter_rows(out: torch.Tensor, full: torch.Tensor, group) -> None:
    """``out`` (n, ...) = this rank's slice of the sum over ranks of ``full`` (world * n, ...)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        part = torch.empty_like(full[: full.shape[0] // world])
        dist.reduce_scatter_tensor(part, full, group=group)
    else:  # gloo has no reduce_scatter_tensor: all-reduce, then keep this rank's slice
        dist.all_reduce(full, group=group)
        part = full.chunk(world)[rank]
    out.copy_(part)


class AllGatherPrepareAndFinalize(NamedGroup, FusedMoEPrepareAndFinalize):
    """Standard-format expert parallelism: all-gather dispatch, reduce-scatter combine.

    Use with ``TritonExperts`` and, in the layer call, ``global_num_experts`` plus an
    ``expert_map`` giving this rank's local ids (-1 for experts on other ranks). Partial sums
    are combined in float32. The group is kept by name (as torch.distributed's functional
    collectives do), so the layer stays a value: it copies, pickles and traces by that name.
    """

    kind = "allgather"

    def __init__(self, group: dist.ProcessGroup | str | None = None) -> None:
        self._group_name = group_name_of(group)

    @classmethod
    def from_op_args(cls, args: tuple[int, ...], group_name: str) -> AllGatherPrepareAndFinalize:
        return cls(group_name)

    @property
    def activation_format(self) -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

    def num_dispatched_tokens(self, num_tokens: int) -> int:
        return num_tokens * dist.get_world_size(self.group)

    def copies_rows(self) -> bool:
        return True

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, a1_scale=None) -> PrepareResult:
        x = all_gather_rows(a1, self.group)
        a1q, scale = quantize_activations(x, quant_config, a1_scale)
        return PrepareResult(a1q, scale, topk_ids=all_gather_rows(topk_ids, self.group),
                             topk_weights=all_gather_rows(topk_weights, self.group))

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input, *,
                 num_experts, expert_map, prepared, num_local_experts, reduced=False) -> None:
        weights = None if apply_router_weight_on_input else prepared.topk_weights
        partial = torch.empty((fused_expert_output.shape[0], output.shape[1]), dtype=torch.float32,
                              device=output.device)
        moe_reduce(fused_expert_output, prepared.topk_ids, num_experts, weights, expert_map, out=partial,
                   num_local_experts=num_local_experts)
        reduce_scatter_rows(output, partial, self.group)
