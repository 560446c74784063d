"""Expert-sorted rows: copy each routed row (and its activation scales) into the align stage's order.

Row p of the output is the input row of slot ``sorted_ids[p]`` (row ``slot // a_row_div``), so each
expert's rows form one run padded to the align block size and every row block of the grouped GEMM
(``moe_grouped_gemm``) is one expert's, loadable as one TMA tile. Padding rows (slot id
>= num_slots) are written as zeros (scales too). With ``row_weights`` each row is multiplied by its
slot's router weight in float32 and rounded once (the backward's weight GEMM when the forward scaled
the input). The grid covers the worst-case row count; programs past the real count
(``num_tokens_post_padded``) return at once. Row offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels.operands import Routing
from tmoe.kernels.sizes import cdiv, next_power_of_2
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.plan import Launch, planned

ROWS_PER_PROGRAM = 16


@triton.jit(do_not_specialize=['num_slots'])
def _sorted_rows_kernel(
    x_ptr,  # [rows, K]
    out_ptr,  # [EM, K]
    x_scale_ptr,  # [rows, S] float32 (HAS_SCALE)
    out_scale_ptr,  # [EM, S] float32 (HAS_SCALE)
    row_weights_ptr,  # [num_slots] float32 (WEIGHTED)
    sorted_ids_ptr,  # [EM] int32
    num_post_padded_ptr,  # [1] int32
    num_slots, a_row_div, K, S,
    stride_xm, stride_om, stride_xsm, stride_xss, stride_osm,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SCALE: tl.constexpr,
    WEIGHTED: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_R
    if first >= tl.load(num_post_padded_ptr):
        return
    rows = first.to(tl.int64) + tl.arange(0, BLOCK_R)  # [BR]
    slots = tl.load(sorted_ids_ptr + rows).to(tl.int64)
    valid = slots < num_slots
    src = tl.where(valid, slots // a_row_div, 0)  # [BR]
    if WEIGHTED:
        w = tl.load(row_weights_ptr + slots, mask=valid, other=0.0)[:, None]  # [BR, 1] float32
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        v = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0)
        if WEIGHTED:
            v = (v.to(tl.float32) * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * stride_om + offs_k[None, :], v, mask=mask_k[None, :])
    if HAS_SCALE:
        offs_s = tl.arange(0, BLOCK_S)
        mask_s = offs_s < S
        s = tl.load(x_scale_ptr + src[:, None] * stride_xsm + offs_s[None, :] * stride_xss,
                    mask=valid[:, None] & mask_s[None, :], other=0.0)
        tl.store(out_scale_ptr + rows[:, None] * stride_osm + offs_s[None, :], s, mask=mask_s[None, :])


@with_interpreter_fixes
@planned
def sorted_rows(
    x: torch.Tensor, routing: Routing, out: torch.Tensor,
    x_scale: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write ``x`` (rows, K) (any dtype, K contiguous) into ``out`` (EM, K) in the order of
    ``routing.sorted_token_ids`` (EM = its length), padding rows zero. ``x_scale`` (rows, S) float32
    per-row scales (fp8 activations: S = 1 per token, K / group per block) go to ``out_scale``
    (EM, S) the same way. ``row_weights`` ([num_slots] float32, with a float ``x``) multiplies
    each row by its slot's weight. Rows past ``num_tokens_post_padded`` are not written. Shapes were checked
    by the caller."""
    em, k = out.shape
    if em == 0 or k == 0:
        return out
    has_scale = x_scale is not None
    s = x_scale.shape[-1] if has_scale else 1
    block_k = min(next_power_of_2(k), 512 if x.element_size() == 1 else 256)
    return Launch(_sorted_rows_kernel, (cdiv(em, ROWS_PER_PROGRAM),), dict(
        x_ptr=x, out_ptr=out, x_scale_ptr=x_scale if has_scale else x, out_scale_ptr=out_scale if has_scale else out,
        row_weights_ptr=row_weights if row_weights is not None else out,
        sorted_ids_ptr=routing.sorted_token_ids, num_post_padded_ptr=routing.num_tokens_post_padded,
        num_slots=routing.num_slots, a_row_div=routing.a_row_div, K=k, S=s,
        stride_xm=x.stride(0), stride_om=out.stride(0),
        stride_xsm=x_scale.stride(0) if has_scale else 0, stride_xss=x_scale.stride(-1) if has_scale else 0,
        stride_osm=out_scale.stride(0) if has_scale else 0,
        BLOCK_R=ROWS_PER_PROGRAM, BLOCK_K=block_k, BLOCK_S=next_power_of_2(s), HAS_SCALE=has_scale,
        WEIGHTED=row_weights is not None, num_warps=4,
    ), out)


def aligned_copy(t: torch.Tensor, routing: Routing, row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """(EM, D) contiguous, new: the rows of ``t`` (rows, D) (any strides) in ``routing``'s order
    through ``sorted_rows``, padding rows zero, each times its slot's weight with ``row_weights``.
    The backward's TMA paths load their token operands from it."""
    out = torch.empty((routing.sorted_token_ids.shape[0], t.shape[1]), dtype=t.dtype, device=t.device)
    t = t if t.stride(-1) == 1 else t.contiguous()  # autograd may hand an expanded grad_out
    return sorted_rows(t, routing, out, row_weights=row_weights)
