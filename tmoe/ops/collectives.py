"""The expert-parallel backward's collectives as ops (``tmoe.ops.autograd``): the all-gather of
the rows and its adjoint, the float32 reduce-scatter."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from tmoe.modular.distributed import all_gather_rows, reduce_scatter_rows


@torch.library.custom_op("tmoe::ep_all_gather", mutates_args=())
def ep_all_gather(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """(world * n, ...) = the ranks' (n, ...) tensors in rank order: the all-gather expert
    parallelism's dispatch, which its backward repeats (for x and routing) and applies to grad_out."""
    return all_gather_rows(t, _resolve_process_group(group_name))


@ep_all_gather.register_fake
def _(t, group_name):
    world = dist.get_world_size(_resolve_process_group(group_name))
    return t.new_empty((world * t.shape[0], *t.shape[1:]))


@torch.library.custom_op("tmoe::ep_reduce_scatter", mutates_args=())
def ep_reduce_scatter(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """(n, ...) float32: this rank's rows of the sum over ranks of ``t`` (world * n, ...), summed
    in float32: the adjoint of ``ep_all_gather``."""
    group = _resolve_process_group(group_name)
    out = torch.empty((t.shape[0] // dist.get_world_size(group), *t.shape[1:]), dtype=torch.float32, device=t.device)
    reduce_scatter_rows(out, t.float(), group)
    return out


@ep_reduce_scatter.register_fake
def _(t, group_name):
    world = dist.get_world_size(_resolve_process_group(group_name))
    return t.new_empty((t.shape[0] // world, *t.shape[1:]), dtype=torch.float32)
