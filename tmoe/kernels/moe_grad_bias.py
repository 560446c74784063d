"""The bias gradients of the expert GEMMs: per expert, the sum of one operand's aligned rows.

    db[e] = sum over the rows r of expert e of L[r]     (P_DIM), L as ``moe_grad_weight``'s left
db2 sums grad_out's rows at each slot's token times the slot's router weight, db1 sums grad_h's
aligned rows. One program per expert and BLOCK_P columns walks the expert's rows in order (the
align's ``expert_offsets``) into a [BR, BP] float32 partial summed once at the end: no atomics,
deterministic. Its own memory-bound kernel, not a reduction inside the weight GEMM (which kept
that operand out of the async-copy pipeline), so a trainable bias of a frozen weight costs no GEMM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels._details.expert_rows import expert_rows, row_block
from tmoe.kernels.sizes import cdiv
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch


@triton.jit(do_not_specialize=['num_slots'])
def _moe_grad_bias_kernel(
    left_ptr,  # TOKENS_LEFT: [M, P_DIM] token rows, else [P, P_DIM] aligned rows
    topk_weights_ptr,  # [num_slots] float32 (WEIGHTED)
    sorted_ids_ptr,  # [P] int32
    expert_offsets_ptr,  # [E + 1] int32
    expert_map_ptr,  # [E] int32 (HAS_MAP)
    bias_ptr,  # [E_local, P_DIM] out
    num_slots, P_DIM, num_local_experts, stride_lm, stride_lk, stride_be,
    TOPK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, TOKENS_LEFT: tl.constexpr,
    HAS_MAP: tl.constexpr, WEIGHTED: tl.constexpr,
):
    """db[e, p] = sum of left[r, p] (WEIGHTED: times the row's router weight) over expert e's rows:
    one program per expert and BLOCK_P columns, a [BR, BP] float32 partial summed once at the end."""
    local, start, end = expert_rows(tl.program_id(0).to(tl.int64), expert_map_ptr, expert_offsets_ptr,
                                    num_local_experts, HAS_MAP)
    if local < 0:
        return
    offs_p = tl.program_id(1).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
    mask_p = offs_p < P_DIM
    acc = tl.zeros((BLOCK_R, BLOCK_P), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows, slots, valid, tokens = row_block(r0, end, sorted_ids_ptr, num_slots, TOPK, BLOCK_R)  # [BR]
        if TOKENS_LEFT:
            l_rows = tokens
        else:
            l_rows = rows
        lt = tl.load(left_ptr + l_rows[:, None] * stride_lm + offs_p[None, :] * stride_lk,
                     mask=valid[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # [BR, BP]
        if WEIGHTED:
            lt *= tl.load(topk_weights_ptr + slots, mask=valid, other=0.0)[:, None]
        acc += lt
    tl.store(bias_ptr + local * stride_be + offs_p, tl.sum(acc, axis=0).to(bias_ptr.dtype.element_ty), mask=mask_p)


BIAS_BLOCK_P, BIAS_BLOCK_R = 128, 64


@with_interpreter_fixes
def moe_grad_bias(
    left: torch.Tensor, topk_weights: torch.Tensor, sorted_ids: torch.Tensor, expert_offsets: torch.Tensor,
    num_local_experts: int, *, tokens_left: bool, weighted: bool, expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """db (E_local, P_DIM) in ``left``'s dtype: db[e] = the sum of left's rows of expert e
    (``weighted``: each times its slot's router weight), ``left`` and the routing as in ``moe_grad_weight``."""
    p_dim = left.shape[1]
    num_experts = expert_offsets.shape[0] - 1
    make = torch.zeros if expert_map is not None else torch.empty
    grad_b = make((num_local_experts, p_dim), dtype=left.dtype, device=left.device)
    if num_local_experts == 0 or p_dim == 0:
        return grad_b
    launch(_moe_grad_bias_kernel, (num_experts, cdiv(p_dim, BIAS_BLOCK_P)),
           left, topk_weights, sorted_ids, expert_offsets,
           expert_map if expert_map is not None else expert_offsets, grad_b,
           topk_weights.numel(), p_dim, num_local_experts, left.stride(0), left.stride(1), grad_b.stride(0),
           TOPK=topk_weights.shape[1], BLOCK_P=BIAS_BLOCK_P, BLOCK_R=BIAS_BLOCK_R, TOKENS_LEFT=tokens_left,
           HAS_MAP=expert_map is not None, WEIGHTED=weighted, num_warps=4)
    return grad_b
