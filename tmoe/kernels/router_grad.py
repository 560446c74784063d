"""Backward of the router top-k: the router logits' gradient from the top-k weights' gradient.

With scores s = softmax(x) (or sigmoid(x)), picked ids i_k, S = sum_k s[i_k]:
    weights_k = c * s[i_k] / S      (renormalize; else c * s[i_k]), c the routed scaling factor
    ds[i_k]   = c * (g_k / S - sum_j g_j s[i_j] / S^2)     (renormalize; else c * g_k), 0 elsewhere
    dx        = s * (ds - <ds, s>)  (softmax)  or  ds * s * (1 - s)  (sigmoid)
The correction bias and the expert groups only select: they take no gradient. NaN logits read as
-inf, as in the forward: score 0, gradient 0. One program per BLOCK_M rows, all E experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels._details.common import _sigmoid
from tmoe.kernels.sizes import cdiv, next_power_of_2
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch


@triton.jit
def _picked(scores, ids_ptr, offs_m, mask_m, k, offs_e, TOPK: tl.constexpr):
    """(one-hot [BM, E_PAD] of pick k, its score [BM])."""
    ids = tl.load(ids_ptr + offs_m * TOPK + k, mask=mask_m, other=-1)  # [BM]
    hot = offs_e[None, :] == ids[:, None]
    return hot, tl.sum(tl.where(hot, scores, 0.0), axis=1)


@triton.jit(do_not_specialize=['M'])
def _topk_route_grad_kernel(
    grad_weights_ptr,  # [M, TOPK] float32, contiguous
    logits_ptr,  # [M, E], last dim contiguous
    ids_ptr,  # [M, TOPK] int32, contiguous
    grad_logits_ptr,  # [M, E] out, contiguous
    M, E, stride_lm, scaling,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, SCORING: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_e = tl.arange(0, E_PAD)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_e < E)[None, :]
    x = tl.load(logits_ptr + offs_m[:, None] * stride_lm + offs_e[None, :], mask=mask,
                other=float("-inf")).to(tl.float32)  # [BM, E_PAD]
    x = tl.where(x == x, x, float("-inf"))
    if SCORING == "softmax":
        num = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = num / tl.sum(num, axis=1)[:, None]
    else:
        scores = _sigmoid(x)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    dot_gs = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if RENORMALIZE:
        for k in tl.static_range(TOPK):
            _, s_k = _picked(scores, ids_ptr, offs_m, mask_m, k, offs_e, TOPK)
            g_k = tl.load(grad_weights_ptr + offs_m * TOPK + k, mask=mask_m, other=0.0)
            total += s_k
            dot_gs += g_k * s_k
    ds = tl.zeros((BLOCK_M, E_PAD), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        hot, _ = _picked(scores, ids_ptr, offs_m, mask_m, k, offs_e, TOPK)
        g_k = tl.load(grad_weights_ptr + offs_m * TOPK + k, mask=mask_m, other=0.0)
        if RENORMALIZE:
            g_k = g_k / total - dot_gs / (total * total)
        ds += tl.where(hot, (g_k * scaling)[:, None], 0.0)
    if SCORING == "softmax":
        dx = scores * (ds - tl.sum(ds * scores, axis=1)[:, None])
    else:
        dx = ds * scores * (1.0 - scores)
    tl.store(grad_logits_ptr + offs_m[:, None] * E + offs_e[None, :], dx.to(grad_logits_ptr.dtype.element_ty),
             mask=mask)


@with_interpreter_fixes
def topk_route_grad(
    grad_weights: torch.Tensor, router_logits: torch.Tensor, topk_ids: torch.Tensor, *, scoring: str = "softmax",
    renormalize: bool = True, routed_scaling_factor: float = 1.0,
) -> torch.Tensor:
    """dL/drouter_logits (M, E) in router_logits' dtype from dL/dtopk_weights (M, topk).

    Args:
        grad_weights: (M, topk) float32; router_logits: (M, E) float16/bfloat16/float32, last dim
            contiguous; topk_ids: (M, topk) int32, the forward's picks (``tmoe.topk_route``).
        scoring, renormalize, routed_scaling_factor: the forward's.
    """
    m, e = router_logits.shape
    topk = topk_ids.shape[1]
    grad_logits = torch.empty((m, e), dtype=router_logits.dtype, device=router_logits.device)
    if m == 0:
        return grad_logits
    e_pad = max(16, next_power_of_2(e))
    block_m = max(1, min(16, 4096 // e_pad))
    launch(_topk_route_grad_kernel, (cdiv(m, block_m),),
           grad_weights.contiguous(), router_logits, topk_ids.contiguous(), grad_logits, m, e, router_logits.stride(0),
           float(routed_scaling_factor), TOPK=topk, BLOCK_M=block_m, E_PAD=e_pad, SCORING=scoring,
           RENORMALIZE=renormalize, num_warps=4)
    return grad_logits
