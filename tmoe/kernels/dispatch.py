"""Batched dispatch: copy each slot's token row into its expert's fixed-capacity batch.

Slots keep ascending slot order within an expert (the align stage's stable order, block size 1);
the first ``capacity`` slots of an expert are kept and the rest dropped, deterministically.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels.checks import FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES, check_tensor
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.sizes import cdiv, next_power_of_2
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch


@triton.jit
def _batched_dispatch_kernel(
    x_ptr,  # [M, K] activations (any float or fp8 dtype)
    x_scale_ptr,  # [M, S] float32 per-token (group) scales, HAS_SCALE only
    sorted_ids_ptr,  # [numel] int32 slots grouped by expert (block size 1)
    offsets_ptr,  # [E + 1] int32 first position of each expert in sorted_ids
    expert_map_ptr,  # [E] int32 global -> local; outside [0, E_local) (-1: remote) is skipped
    out_ptr,  # [E_local, CAP, K]
    out_scale_ptr,  # [E_local, CAP, S]
    expert_num_tokens_ptr,  # [E_local] int32, zeroed by the launcher
    dispatch_rows_ptr,  # [numel] int32: row in (E_local * CAP, K) or -1 (dropped, remote)
    K, S, topk, capacity, num_local_experts,
    stride_xm, stride_sm, stride_oe, stride_om, stride_ose, stride_osm,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_MAP: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    expert = tl.program_id(0)
    pid_r = tl.program_id(1)
    start = tl.load(offsets_ptr + expert)
    count = tl.load(offsets_ptr + expert + 1) - start
    local = expert
    if HAS_MAP:
        local = tl.load(expert_map_ptr + expert)
    local = local.to(tl.int64)
    local = tl.where((local >= 0) & (local < num_local_experts), local, -1)
    if (pid_r == 0) & (local >= 0):
        tl.store(expert_num_tokens_ptr + local, tl.minimum(count, capacity))
    for r0 in range(pid_r * BLOCK_R, count, tl.num_programs(1) * BLOCK_R):
        rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR]; rows * stride_om reaches capacity * K
        mask_r = rows < count
        slots = tl.load(sorted_ids_ptr + start + rows, mask=mask_r, other=0)
        kept = mask_r & (rows < capacity) & (local >= 0)
        dest = tl.where(kept, local * capacity + rows, -1)
        tl.store(dispatch_rows_ptr + slots, dest.to(tl.int32), mask=mask_r)
        tokens = (slots // topk).to(tl.int64)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = kept[:, None] & (offs_k[None, :] < K)
            vals = tl.load(x_ptr + tokens[:, None] * stride_xm + offs_k[None, :], mask=mask)  # [BR, BK]
            tl.store(out_ptr + local * stride_oe + rows[:, None] * stride_om + offs_k[None, :], vals, mask=mask)
        if HAS_SCALE:
            offs_s = tl.arange(0, BLOCK_S)
            mask = kept[:, None] & (offs_s[None, :] < S)
            vals = tl.load(x_scale_ptr + tokens[:, None] * stride_sm + offs_s[None, :], mask=mask)
            tl.store(out_scale_ptr + local * stride_ose + rows[:, None] * stride_osm + offs_s[None, :], vals, mask=mask)


@triton.jit
def _zero_kernel(ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros((BLOCK,), dtype=ptr.dtype.element_ty), mask=offs < n)


@with_interpreter_fixes
def batched_dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    num_local_experts: int,
    capacity: int,
    x_scale: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Scatter token rows into ``(num_local_experts, capacity, K)`` batches.

    Args:
        x: (M, K) float or fp8 activations, last dim contiguous.
        topk_ids: (M, topk) int32/int64 global expert ids; out-of-range ids are skipped.
        num_experts: global expert count E; ``expert_map`` (E,) int32 maps to local ids, a value
            outside [0, num_local_experts) (-1: remote) skips the slot.
        num_local_experts: batches in the output; without a map, ids >= it are skipped too.
        capacity: rows per expert; an expert's slots beyond it are dropped (lowest slots kept).
        x_scale: optional (M, S) float32 per-token scales, dispatched alongside.

    Returns:
        batches (E_local, capacity, K) in x.dtype (rows past ``expert_num_tokens`` unwritten),
        batch scales (E_local, capacity, S) or None, expert_num_tokens (E_local,) int32 (0 for
        a local expert no global id maps to),
        dispatch_rows (M, topk) int32: each slot's row in the (E_local * capacity, K) view, or -1
        if dropped or remote (slots with out-of-range ids are left unwritten).
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES + FP8_DTYPES, ndim=2)
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, ndim=2, device=x.device, contiguous=True)
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows but x has {x.shape[0]}")
    if x.shape[1] and x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dimension")
    if capacity < 1:
        raise ValueError(f"capacity must be positive, got {capacity}")
    m, k = x.shape
    dev = x.device
    out = torch.empty((num_local_experts, capacity, k), dtype=x.dtype, device=dev)
    expert_num_tokens = torch.empty(num_local_experts, dtype=torch.int32, device=dev)
    launch(_zero_kernel, (cdiv(num_local_experts, 1024),), expert_num_tokens, num_local_experts,
           BLOCK=1024)  # locals nothing maps to stay 0 (a Triton launch: a layer call's replay repeats it)
    dispatch_rows = torch.empty(topk_ids.shape, dtype=torch.int32, device=dev)
    out_scale = None
    s = 0
    if x_scale is not None:
        check_tensor("x_scale", x_scale, dtypes=(torch.float32,), ndim=2, device=dev)
        s = x_scale.shape[1]
        out_scale = torch.empty((num_local_experts, capacity, s), dtype=torch.float32, device=dev)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    sorted_ids, _, _ = moe_align_block_size(topk_ids, 1, num_experts, expert_offsets=offsets)
    block_r = 16
    grid = (num_experts, max(1, min(cdiv(capacity, block_r), 64)))
    scale_ref = x_scale if x_scale is not None else x
    out_scale_ref = out_scale if out_scale is not None else out
    launch(_batched_dispatch_kernel, grid,
        x, scale_ref, sorted_ids, offsets, expert_map if expert_map is not None else offsets,
        out, out_scale_ref, expert_num_tokens, dispatch_rows,
        K=k, S=s, topk=topk_ids.shape[1], capacity=capacity, num_local_experts=num_local_experts,
        stride_xm=x.stride(0), stride_sm=scale_ref.stride(0), stride_oe=out.stride(0), stride_om=out.stride(1),
        stride_ose=out_scale_ref.stride(0), stride_osm=out_scale_ref.stride(1),
        BLOCK_R=block_r, BLOCK_K=min(256, next_power_of_2(max(k, 16))),
        BLOCK_S=next_power_of_2(max(s, 1)), HAS_MAP=expert_map is not None, HAS_SCALE=x_scale is not None,
    )
    return out, out_scale, expert_num_tokens, dispatch_rows
