"""All-to-all expert parallelism with fixed capacity: each (token, expert) slot travels only to
the rank that owns the expert, and its output travels back.

One step on rank r (W ranks, E experts, E_local = E / W, capacity C per (rank, local expert)):

1. quantize the tokens (fp8 when the quant config asks; dynamic per-token or per-group scales
   travel with their rows);
2. ``batched_dispatch`` writes every slot into send buffer ``(W, E_local, C, K)`` at
   [owner(e), local(e), j], j the slot's rank among this rank's slots of expert e in slot order
   (token-major): **the first C slots of each (destination rank, local expert) are kept, the
   rest dropped** (they contribute zero and are counted, see ``dropped_slots``);
3. ``all_to_all_single`` of the buffer, its counts (and scales) with equal, static splits;
4. ``ep_permute`` packs the received segments into the experts' ``(E_local, W * C, K)`` batches
   (source rank order, so each batch is the stable concatenation of what every rank sent);
5. after the experts, ``ep_permute`` puts the outputs back into the segment layout, a second
   ``all_to_all_single`` returns them, and ``moe_reduce`` applies the router weights and sums
   the top-k slots in float32 (slots dropped or with out-of-range ids contribute exactly zero).

Every shape comes from (E, C, K): no host sync and no data-dependent shape, so with NCCL a step
captures in a CUDA graph. gloo (CPU tests) has all_to_all_single but rejects float8 (and
int16) tensors ("Invalid scalar type"), so buffers travel as raw bytes (uint8 views) on every
backend; the collective is byte-agnostic, so this costs nothing on NCCL.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tmoe.kernels.checks import positive_int
from tmoe.kernels.dispatch import batched_dispatch
from tmoe.kernels.ep_permute import ep_permute
from tmoe.kernels.reduce import moe_reduce
from tmoe.modular.distributed import NamedGroup, group_name_of
from tmoe.modular.interfaces import FusedMoEActivationFormat, FusedMoEPrepareAndFinalize, PrepareResult
from tmoe.modular.placement import PLACEMENTS, check_placement, send_buffer_map
from tmoe.modular.quantize import quantize_activations

# cumulative dropped-slot counters, one per (value of the PrepareAndFinalize, device): see dropped_slots
_DROPPED: dict[tuple, torch.Tensor] = {}


def _all_to_all(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Rank r's chunk s of the result = rank s's chunk r of ``t`` (W equal chunks along dim 0), as bytes."""
    t = t.contiguous()
    out = torch.empty_like(t)
    dist.all_to_all_single(out.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8), group=group)
    return out


def kept_slot_ids(topk_ids: torch.Tensor, tokens_per_rank: int, capacity: int, num_experts: int) -> torch.Tensor:
    """The gathered routing of every rank (W * tokens_per_rank, topk) with the slots the forward's
    dispatch dropped set to -1: on each source rank, the slots of an expert past its first
    ``capacity`` in slot order (token-major), as ``batched_dispatch`` keeps them. Device ops only
    (a stable sort per rank), no host sync."""
    m, topk = topk_ids.shape
    ids = topk_ids.reshape(m // tokens_per_rank, tokens_per_rank * topk).long()
    keys = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # unrouted slots sort last
    order = torch.argsort(keys, dim=1, stable=True)
    ranked = keys.gather(1, order)
    # a slot's rank among its expert's: its sorted position minus the position of the expert's first slot
    within = torch.arange(ranked.shape[1], device=ids.device) - torch.searchsorted(ranked, ranked, side="left")
    ordinal = torch.empty_like(within).scatter_(1, order, within)
    return torch.where(ordinal < capacity, topk_ids.reshape(ids.shape), -1).reshape(m, topk).to(topk_ids.dtype)


@dataclass(frozen=True)
class AllToAllPrepareResult(PrepareResult):
    """``PrepareResult`` plus what finalize needs to send outputs back: the received counts
    ``recv_counts`` (W * E_local,) int32 (clamped to C, source-rank major) and their
    ``recv_offsets`` within each expert's batch."""

    recv_counts: torch.Tensor | None = None
    recv_offsets: torch.Tensor | None = None


class AllToAllPrepareAndFinalize(NamedGroup, FusedMoEPrepareAndFinalize):
    """BatchedExperts-format expert parallelism: all-to-all dispatch and combine with fixed capacity.

    Args:
        group: process group (or its name; None: the default group). Kept by name, so the
            layer op stays a value.
        max_tokens_per_rank: the most tokens one rank passes per call (checked).
        num_experts: global expert count E, a multiple of the world size W.
        capacity: rows per (rank, local expert) buffer, C; default ``max_tokens_per_rank`` (no
            drops while a token's top-k ids are distinct). Send and receive buffers are
            (E, C, K) each; the experts see batches of ``expert_capacity = W * C`` rows.
        placement: "contiguous" or "round_robin" (``tmoe.modular.placement``); the layer call's
            ``expert_map`` and weight shards must follow it (``expert_map``/``shard_experts``).

    Use with ``BatchedTritonExperts(pf.expert_capacity)``; every rank calls the layer each step
    (with 0 tokens too). Dropped slots: see the module docstring and ``dropped_slots``.
    """

    kind = "alltoall"

    def __init__(self, group: dist.ProcessGroup | str | None, max_tokens_per_rank: int, num_experts: int,
                 capacity: int | None = None, placement: str = "contiguous") -> None:
        self._group_name = group_name_of(group)
        self.max_tokens_per_rank = positive_int("max_tokens_per_rank", max_tokens_per_rank)
        self.num_experts = positive_int("num_experts", num_experts)
        self.capacity = self.max_tokens_per_rank if capacity is None else positive_int("capacity", capacity)
        self.world_size = dist.get_world_size(self.group)
        self.num_local_experts = check_placement(placement, self.num_experts, self.world_size)
        self.placement = placement
        self._maps: dict[torch.device, torch.Tensor | None] = {}
        self._counters: dict[torch.device, torch.Tensor] = {}  # dropped_slots per device, looked up once

    def op_args(self) -> tuple[int, ...]:
        return (self.max_tokens_per_rank, self.num_experts, self.capacity, PLACEMENTS.index(self.placement))

    @classmethod
    def from_op_args(cls, args: tuple[int, ...], group_name: str) -> AllToAllPrepareAndFinalize:
        max_tokens, num_experts, capacity, placement = args
        return cls(group_name, max_tokens, num_experts, capacity, PLACEMENTS[placement])

    @property
    def expert_capacity(self) -> int:
        """Rows of each local expert's batch, W * C: the ``max_num_tokens`` of the experts."""
        return self.world_size * self.capacity

    @property
    def activation_format(self) -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.BatchedExperts

    def max_num_tokens_per_rank(self) -> int:
        return self.expert_capacity

    def runs_with_no_tokens(self) -> bool:
        return True

    def check_local_experts(self, num_local_experts: int) -> None:
        if num_local_experts != self.num_local_experts:
            raise ValueError(f"AllToAllPrepareAndFinalize(num_experts={self.num_experts}) over {self.world_size} "
                             f"ranks needs {self.num_local_experts} local experts in w1/w2, got {num_local_experts}")

    def dropped_slots(self, device: torch.device | str) -> torch.Tensor:
        """() int64 on ``device``: slots this rank sent that found their (rank, expert) buffer
        full, summed over every step since the first (or ``reset_dropped_slots``).

        The layer op rebuilds its PrepareAndFinalize from its value, so the counter belongs to
        the value: every AllToAllPrepareAndFinalize equal to this one (same group, sizes,
        placement) on ``device`` adds to the same tensor. Read it after a step without a sync
        on the device, or ``.item()`` it on the host. Call it (or run one step) before CUDA-graph
        capture so that capture finds the counter allocated; replays then add to it."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (self._group_name, *self.op_args(), str(device))
        counter = _DROPPED.get(key)
        if counter is None:
            counter = _DROPPED[key] = torch.zeros((), dtype=torch.int64, device=device)
        return counter

    def reset_dropped_slots(self, device: torch.device | str) -> None:
        self.dropped_slots(device).zero_()

    def _send_map(self, device: torch.device) -> torch.Tensor | None:
        if device not in self._maps:
            self._maps[device] = send_buffer_map(self.num_experts, self.world_size, self.placement, device)
        return self._maps[device]

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, a1_scale=None) -> AllToAllPrepareResult:
        if apply_router_weight_on_input:
            raise ValueError("apply_router_weight_on_input is not supported by AllToAllPrepareAndFinalize")
        if num_experts != self.num_experts:
            raise ValueError(f"global_num_experts={num_experts} differs from AllToAllPrepareAndFinalize's "
                             f"num_experts={self.num_experts}")
        if a1.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"hidden_states has {a1.shape[0]} tokens, more than max_tokens_per_rank="
                             f"{self.max_tokens_per_rank}")
        group, world, e_local, cap = self.group, self.world_size, self.num_local_experts, self.capacity
        a1q, scale = quantize_activations(a1, quant_config, a1_scale)
        row_scale = scale if scale is not None and a1_scale is None else None  # as BatchedPrepareAndFinalize
        send, send_scale, send_counts, rows = batched_dispatch(
            a1q, topk_ids, num_experts, num_experts, cap, x_scale=row_scale, expert_map=self._send_map(a1.device),
        )
        routed = (topk_ids >= 0) & (topk_ids < num_experts)
        counter = self._counters.get(a1.device)
        if counter is None:
            counter = self._counters[a1.device] = self.dropped_slots(a1.device)
        counter.add_((routed & (rows < 0)).sum())
        k = a1q.shape[1]
        recv = _all_to_all(send.view(num_experts * cap, k), group)
        counts = _all_to_all(send_counts, group).clamp_(0, cap)  # (W * E_local,) bounded whatever arrives
        per_source = counts.view(world, e_local)
        offsets = (per_source.cumsum(0) - per_source).to(torch.int32).view(-1)
        expert_num_tokens = per_source.sum(0, dtype=torch.int32)
        permute = dict(num_local_experts=e_local, capacity=cap, to_batch=True)
        batches = ep_permute(recv, counts, offsets, **permute).view(e_local, world * cap, k)
        batch_scale = scale
        if row_scale is not None:
            s = send_scale.shape[-1]
            recv_scale = _all_to_all(send_scale.view(num_experts * cap, s), group)
            batch_scale = ep_permute(recv_scale, counts, offsets, **permute).view(e_local, world * cap, s)
        return AllToAllPrepareResult(batches, batch_scale, expert_num_tokens, rows, recv_counts=counts,
                                     recv_offsets=offsets)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input, *,
                 num_experts, expert_map, prepared, num_local_experts, reduced=False) -> None:
        k = fused_expert_output.shape[-1]
        y = fused_expert_output.reshape(-1, k)  # (E_local * W * C, K) batches
        segments = ep_permute(y, prepared.recv_counts, prepared.recv_offsets, num_local_experts=self.num_local_experts,
                              capacity=self.capacity, to_batch=False)
        back = _all_to_all(segments, self.group)  # (W * E_local * C, K): the send buffer's layout
        moe_reduce(back, topk_ids, num_experts, topk_weights, None, out=output, rows=prepared.dispatch_rows)
