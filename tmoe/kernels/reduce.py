"""Weighted top-k reduce: out[m] = sum_t w[m, t] * y[m, t] over the slots some local expert computed."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_shape, check_tensor
from tmoe.kernels._details.common import local_expert
from tmoe.kernels.sizes import cdiv, check_num_local_experts, next_power_of_2
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from tmoe.runtime.plan import Launch, planned


@triton.jit
def _moe_reduce_kernel(
    y_ptr,  # [M, TOPK, K]
    weights_ptr,  # [M, TOPK] float32
    topk_ids_ptr,  # [M, TOPK] int32/int64
    expert_map_ptr,  # [E] int32
    rows_ptr,  # [M, TOPK] int32 row of each slot in y viewed as [rows, K], -1 = not computed (HAS_ROWS)
    out_ptr,  # [M, K]
    K, num_experts, num_local_experts,
    stride_ym, stride_yt, stride_yk, stride_wm, stride_im, stride_om, stride_ok,
    TOPK: tl.constexpr, BLOCK_K: tl.constexpr,
    APPLY_WEIGHTS: tl.constexpr, HAS_MAP: tl.constexpr, HAS_ROWS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    offs_k = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for t in tl.static_range(TOPK):
        computed = local_expert(topk_ids_ptr + pid_m * stride_im, expert_map_ptr, t, num_experts, num_local_experts,
                                HAS_MAP) >= 0
        if HAS_ROWS:
            row = tl.load(rows_ptr + pid_m * TOPK + t, mask=computed, other=-1).to(tl.int64)
            computed &= row >= 0
            y_row = y_ptr + row * stride_yt
        else:
            y_row = y_ptr + pid_m * stride_ym + t * stride_yt
        # slots nothing computed are never read, their weights neither: they contribute exactly zero
        y = tl.load(y_row + offs_k * stride_yk, mask=mask_k & computed, other=0.0)
        y = y.to(tl.float32)
        if APPLY_WEIGHTS:
            y *= tl.load(weights_ptr + pid_m * stride_wm + t, mask=computed, other=0.0)
        acc += y
    pdl_launch_dependents(USE_PDL)
    tl.store(out_ptr + pid_m * stride_om + offs_k * stride_ok, acc.to(out_ptr.dtype.element_ty), mask=mask_k)


@with_interpreter_fixes
def moe_reduce(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    topk_weights: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    *,
    num_local_experts: int | None = None,
) -> torch.Tensor:
    """out[m, :] = sum_t w[m, t] * y[m, t, :], accumulated in float32, over computed slots.

    Args:
        y: (M, topk, K) float expert outputs in slot order; with ``rows``, any (R, K) tensor.
        topk_ids: (M, topk) int32/int64; a slot whose id is outside [0, num_experts) or
            (with ``expert_map``) remote is skipped, never read.
        num_experts: global expert count.
        topk_weights: (M, topk) float32, or None when the down GEMM already applied them.
        expert_map: optional (num_experts,) int32, global id -> local id; a value outside
            [0, num_local_experts) (-1: remote) skips the slot.
        out: optional (M, K) output, ``y.dtype`` by default.
        rows: optional (M, topk) int32, contiguous: slot (m, t) reads y[rows[m, t]]; -1 skips it.
        num_local_experts: the local expert count with ``expert_map`` (None: ``num_experts``, vLLM's
            contract; mapped ids at or past the true count are then not caught).

    Returns:
        (M, K) tensor.
    """
    if out is None:
        check_tensor("y", y, dtypes=FLOAT_DTYPES, ndim=3 if rows is None else 2)
        check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, ndim=2, device=y.device)
        out = torch.empty((topk_ids.shape[0], y.shape[-1]), dtype=y.dtype, device=y.device)
    return _moe_reduce_into(y, topk_ids, num_experts, topk_weights, expert_map, out, rows,
                            num_local_experts=num_local_experts)


@planned
def _moe_reduce_into(
    y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None,
    expert_map: torch.Tensor | None, out: torch.Tensor, rows: torch.Tensor | None, *, num_local_experts: int | None,
) -> torch.Tensor | Launch:
    """``moe_reduce`` into ``out``: checks, then the launch (planned: once per signature)."""
    check_tensor("y", y, dtypes=FLOAT_DTYPES, ndim=3 if rows is None else 2)
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, ndim=2, device=y.device)
    m, topk = topk_ids.shape
    k = y.shape[-1]
    if rows is None:
        check_shape("y", y, (m, topk, k))
    else:
        check_tensor("rows", rows, dtypes=(torch.int32,), ndim=2, device=y.device, contiguous=True)
        check_shape("rows", rows, (m, topk))
    if topk_ids.stride(1) != 1:
        raise ValueError("topk_ids must be contiguous along its last dimension")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2, device=y.device)
        check_shape("topk_weights", topk_weights, (m, topk))
        if topk_weights.stride(1) != 1:
            raise ValueError("topk_weights must be contiguous along its last dimension")
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, device=y.device, contiguous=True)
        check_shape("expert_map", expert_map, (num_experts,))
    num_local_experts = check_num_local_experts(num_local_experts, expert_map, num_experts)
    check_tensor("out", out, dtypes=FLOAT_DTYPES, ndim=2, device=y.device)
    check_shape("out", out, (m, k))
    if m == 0 or k == 0:
        return out
    block_k = min(1024, next_power_of_2(k))
    weights = topk_weights if topk_weights is not None else y
    return Launch(_moe_reduce_kernel, (m, cdiv(k, block_k)), dict(
        y_ptr=y, weights_ptr=weights, topk_ids_ptr=topk_ids,
        expert_map_ptr=expert_map if expert_map is not None else topk_ids,
        rows_ptr=rows if rows is not None else topk_ids, out_ptr=out,
        K=k, num_experts=num_experts, num_local_experts=num_local_experts,
        stride_ym=y.stride(0) if rows is None else 0, stride_yt=y.stride(-2), stride_yk=y.stride(-1),
        stride_wm=weights.stride(0), stride_im=topk_ids.stride(0), stride_om=out.stride(0), stride_ok=out.stride(1),
        TOPK=topk, BLOCK_K=block_k, APPLY_WEIGHTS=topk_weights is not None, HAS_MAP=expert_map is not None,
        HAS_ROWS=rows is not None,
        num_warps=4, **pdl_args(),
    ), out)
