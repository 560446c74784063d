"""The public stage functions ``tmoe.<stage>``: keyword-friendly calls of the stage ops
``torch.ops.tmoe.<stage>``, so each compiles with ``torch.compile(fullgraph=True)``. Shapes,
dtypes and semantics are the launchers' (``tmoe.kernels.*``), documented there. Float options
default to None (then the literal default): dynamo traces a float taken from a default as a
symbolic float, which the ops' float arguments cannot take, and would trace the function twice."""
from __future__ import annotations

import torch


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         expert_map: torch.Tensor | None = None, num_local_experts: int | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded): slots grouped by expert, each run
    padded to ``block_size`` (vLLM's contract); see ``tmoe.kernels.align.moe_align_block_size``.

    Example:
        >>> sorted_ids, expert_ids, ntpp = tmoe.moe_align_block_size(topk_ids, 16, 8)
    """
    return torch.ops.tmoe.moe_align_block_size(topk_ids, block_size, num_experts, expert_map, num_local_experts)


def moe_reduce(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None = None,
               expert_map: torch.Tensor | None = None, num_local_experts: int | None = None) -> torch.Tensor:
    """(M, K) = sum_t topk_weights[m, t] * y[m, t] in float32, y (M, topk, K); slots of
    out-of-range or remote experts contribute exactly 0. See ``tmoe.kernels.reduce.moe_reduce``."""
    return torch.ops.tmoe.moe_reduce(y, topk_ids, num_experts, topk_weights, expert_map, num_local_experts)


def topk_route(router_logits: torch.Tensor, topk: int, *, scoring: str = "softmax", renormalize: bool = True,
               num_expert_group: int | None = None, topk_group: int | None = None,
               e_score_correction_bias: torch.Tensor | None = None,
               routed_scaling_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights (M, topk) float32, topk_ids (M, topk) int32) from router_logits (M, E);
    softmax or sigmoid scoring, DeepSeek-V3's grouped top-k and correction bias. See
    ``tmoe.kernels.router.topk_route``.

    Example:
        >>> w, ids = tmoe.topk_route(logits, 8, scoring="sigmoid", num_expert_group=8, topk_group=4,
        ...                          e_score_correction_bias=bias, routed_scaling_factor=2.5)
    """
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError("num_expert_group and topk_group must be given together")
    if num_expert_group is not None and (num_expert_group < 1 or topk_group < 1):
        raise ValueError(f"num_expert_group and topk_group must be positive, got {num_expert_group}, {topk_group}")
    return torch.ops.tmoe.topk_route(router_logits, topk, scoring, renormalize, num_expert_group or 0,
                                     topk_group or 0, e_score_correction_bias,
                                     1.0 if routed_scaling_factor is None else routed_scaling_factor)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int, eps: float | None = None,
                              column_major_scales: bool = False,
                              use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 (..., K), float32 scales (..., K // group_size)), scale = max(absmax, eps) / 448 per
    group (vLLM's contract). See ``tmoe.kernels.quant.per_token_group_quant_fp8``."""
    return torch.ops.tmoe.per_token_group_quant_fp8(x, group_size, 1e-10 if eps is None else eps, column_major_scales,
                                                    use_ue8m0)


def per_token_quant_fp8(x: torch.Tensor, eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 (..., K), float32 scales (..., 1)): one dynamic scale per token."""
    return torch.ops.tmoe.per_token_quant_fp8(x, 1e-10 if eps is None else eps)


def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 (..., K) = clamp(x / scale, ±448), ``scale`` one float32 element on x's device."""
    return torch.ops.tmoe.static_quant_fp8(x, scale)
