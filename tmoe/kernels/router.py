"""Router top-k: scores from the router logits, optional grouped top-k, top-k experts and weights.

One kernel covers Mixtral / Qwen3-MoE (softmax) and DeepSeek-V3 (sigmoid, correction bias,
grouped top-k, routed scaling factor). Each program owns BLOCK_M rows and all E experts and
picks by iterative argmax: k rounds of row max, then the lowest expert index holding it, so
ties always go to the lowest index and the result is deterministic.

The selection key is the float32 logit when there is no correction bias (softmax and sigmoid
are monotone, so this is top-k by score, and exact), else ``score + bias``. NaN logits are read
as -inf: they lose to every other logit and get score 0; a row whose logits are all NaN still
gets distinct in-range ids (lowest first) and NaN (softmax) or, renormalized, NaN weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels.checks import FLOAT_DTYPES, check_last_dim_contiguous, check_shape, check_tensor
from tmoe.kernels._details.common import _sigmoid
from tmoe.kernels.sizes import cdiv, next_power_of_2
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch

MAX_EXPERTS = 512
SCORINGS = ("softmax", "sigmoid")


@triton.jit(do_not_specialize=['M'])
def _topk_route_kernel(
    logits_ptr,  # [M, E] float16/bfloat16/float32, last dim contiguous
    bias_ptr,  # [E] float32, HAS_BIAS only
    weights_ptr,  # [M, TOPK] float32, contiguous
    ids_ptr,  # [M, TOPK] int32, contiguous
    M, E, stride_lm, scaling,
    TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
    SCORING: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] int64
    offs_e = tl.arange(0, E_PAD)
    mask_m = offs_m < M
    mask_e = offs_e < E
    x = tl.load(
        logits_ptr + offs_m[:, None] * stride_lm + offs_e[None, :],
        mask=mask_m[:, None] & mask_e[None, :], other=float("-inf"),
    ).to(tl.float32)  # [BM, E_PAD]
    x = tl.where(x == x, x, float("-inf"))
    if SCORING == "softmax":
        num = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = num / tl.sum(num, axis=1)[:, None]  # [BM, E_PAD]
    else:
        scores = _sigmoid(x)
    if HAS_BIAS:
        key = scores + tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0)[None, :]
    else:
        key = x
    avail = tl.broadcast_to(mask_e[None, :], (BLOCK_M, E_PAD))  # [BM, E_PAD] not yet picked
    if NUM_GROUPS > 0:
        group = offs_e // GROUP_SIZE  # [E_PAD]; padded columns fall in groups >= NUM_GROUPS
        group_score = tl.full((BLOCK_M, E_PAD), float("-inf"), tl.float32)  # [BM, E_PAD] per column's group
        for g in range(NUM_GROUPS):
            in_g = (group == g)[None, :]
            v = tl.where(in_g, key, float("-inf"))
            best = tl.max(v, axis=1)  # [BM]
            if HAS_BIAS and GROUP_SIZE > 1:  # DeepSeek-V3: sum of the group's top-2 biased scores
                first = tl.min(tl.where(v == best[:, None], offs_e[None, :], E_PAD), axis=1)
                best += tl.max(tl.where(offs_e[None, :] == first[:, None], float("-inf"), v), axis=1)
            group_score = tl.where(in_g, best[:, None], group_score)
        keep = tl.zeros((BLOCK_M, E_PAD), tl.int1)  # [BM, E_PAD] column's group is kept
        for _ in range(TOPK_GROUP):
            open_g = avail & ~keep
            best = tl.max(tl.where(open_g, group_score, float("-inf")), axis=1)
            pick = tl.min(tl.where(open_g & (group_score == best[:, None]), group[None, :], NUM_GROUPS), axis=1)
            keep |= group[None, :] == pick[:, None]
        key = tl.where(keep, key, float("-inf"))
    offs_k = tl.arange(0, TOPK_PAD)
    topk_w = tl.zeros((BLOCK_M, TOPK_PAD), tl.float32)  # [BM, TOPK_PAD]
    topk_i = tl.zeros((BLOCK_M, TOPK_PAD), tl.int32)
    for k in range(TOPK):
        sel = tl.where(avail, key, float("-inf"))
        best = tl.max(sel, axis=1)  # [BM]
        idx = tl.min(tl.where(avail & (sel == best[:, None]), offs_e[None, :], E_PAD), axis=1)  # [BM]
        hit = offs_e[None, :] == idx[:, None]  # [BM, E_PAD]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        avail &= ~hit
        topk_w = tl.where(offs_k[None, :] == k, w[:, None], topk_w)
        topk_i = tl.where(offs_k[None, :] == k, idx[:, None], topk_i)
    if RENORMALIZE:
        topk_w = topk_w / tl.sum(topk_w, axis=1)[:, None]
    topk_w = topk_w * scaling
    out_offs = offs_m[:, None] * TOPK + offs_k[None, :]  # [BM, TOPK_PAD]
    mask_out = mask_m[:, None] & (offs_k[None, :] < TOPK)
    tl.store(weights_ptr + out_offs, topk_w, mask=mask_out)
    tl.store(ids_ptr + out_offs, topk_i, mask=mask_out)


def _check_int(name: str, v: object, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


@with_interpreter_fixes
def topk_route(
    router_logits: torch.Tensor,
    topk: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids = top-k of key(logits) per row (ties: lowest index); w = score[ids] / sum (if renormalize) * scale.

    Args:
        router_logits: (M, E) float16/bfloat16/float32, last dim contiguous, E <= 512;
            computed in float32.
        topk: experts per token, 1 <= topk <= E.
        scoring: "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3).
        renormalize: divide the picked weights by their sum.
        num_expert_group, topk_group: grouped top-k (DeepSeek-V3): the E experts form
            num_expert_group equal groups; only the topk_group best groups (group score: sum of
            the top-2 biased scores with a bias, else the group max) are eligible.
        e_score_correction_bias: optional (E,) float32 added to the scores for selection only.
        routed_scaling_factor: multiplies the final weights.

    Returns:
        topk_weights (M, topk) float32 and topk_ids (M, topk) int32, in pick order.

    Example:
        >>> w, ids = topk_route(logits, 8, scoring="sigmoid", num_expert_group=8, topk_group=4,
        ...                     e_score_correction_bias=bias, routed_scaling_factor=2.5)
    """
    check_tensor("router_logits", router_logits, dtypes=FLOAT_DTYPES, ndim=2)
    check_last_dim_contiguous("router_logits", router_logits)
    m, e = router_logits.shape
    _check_int("num_experts (router_logits.shape[1])", e, 1, MAX_EXPERTS)
    _check_int("topk", topk, 1, e)
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError("num_expert_group and topk_group must be given together")
    num_groups = group_size = groups_kept = 0
    if num_expert_group is not None:
        num_groups = _check_int("num_expert_group", num_expert_group, 1, e)
        if e % num_groups:
            raise ValueError(f"num_expert_group={num_groups} must divide the expert count {e}")
        group_size = e // num_groups
        groups_kept = _check_int("topk_group", topk_group, 1, num_groups)
        if topk > groups_kept * group_size:
            raise ValueError(f"topk={topk} exceeds the {groups_kept * group_size} experts of topk_group groups")
    bias = e_score_correction_bias
    if bias is not None:
        check_tensor("e_score_correction_bias", bias, dtypes=(torch.float32,), ndim=1, device=router_logits.device,
                     contiguous=True)
        check_shape("e_score_correction_bias", bias, (e,))
    dev = router_logits.device
    topk_weights = torch.empty((m, topk), dtype=torch.float32, device=dev)
    topk_ids = torch.empty((m, topk), dtype=torch.int32, device=dev)
    if m == 0:
        return topk_weights, topk_ids
    e_pad = max(16, next_power_of_2(e))
    block_m = max(1, min(32, 4096 // e_pad))
    launch(_topk_route_kernel, (cdiv(m, block_m),),
        router_logits, bias if bias is not None else router_logits, topk_weights, topk_ids,
        M=m, E=e, stride_lm=router_logits.stride(0), scaling=float(routed_scaling_factor),
        TOPK=topk, TOPK_PAD=next_power_of_2(topk), BLOCK_M=block_m, E_PAD=e_pad,
        SCORING=scoring, RENORMALIZE=bool(renormalize), HAS_BIAS=bias is not None,
        NUM_GROUPS=num_groups, GROUP_SIZE=group_size, TOPK_GROUP=groups_kept,
        num_warps=4,
    )
    return topk_weights, topk_ids
