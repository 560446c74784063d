"""Every ``torch.ops.tmoe.*`` custom op and its fake (meta) implementation: the one file that
touches ``torch.library``. Implementations call the stage launchers; fakes check shapes with
``torch._check`` and return tensors sized from static shapes only."""
from __future__ import annotations

from dataclasses import replace

import torch

from tmoe.checks import FP8_DTYPES
from tmoe.config import get_config
from tmoe.kernels.align import align_output_sizes, moe_align_block_size as _align
from tmoe.kernels.gemm_args import Scales, check_gemm_operands
from tmoe.kernels.moe_gemm import Routing, invoke_moe_gemm
from tmoe.kernels.quant import (
    FP8_DTYPE,
    alloc_group_scales,
    per_token_group_quant_fp8 as _per_token_group_quant_fp8,
    per_token_quant_fp8 as _per_token_quant_fp8,
    static_quant_fp8 as _static_quant_fp8,
)
from tmoe.kernels.reduce import moe_reduce as _reduce
from tmoe.kernels.router import topk_route as _topk_route


@torch.library.custom_op("tmoe::moe_align_block_size", mutates_args=())
def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _align(topk_ids, block_size, num_experts, expert_map)


@moe_align_block_size.register_fake
def _(topk_ids, block_size, num_experts, expert_map=None):
    max_padded, num_blocks = align_output_sizes(topk_ids.numel(), block_size, num_experts)
    new = topk_ids.new_empty
    return new(max_padded, dtype=torch.int32), new(num_blocks, dtype=torch.int32), new(1, dtype=torch.int32)


def _scales(a_scale: torch.Tensor | None, w_scale: torch.Tensor | None, block_shape: list[int] | None) -> Scales | None:
    if a_scale is None and w_scale is None:
        return None
    if a_scale is None or w_scale is None:
        raise ValueError("a_scale and w_scale must be given together for fp8 operands")
    return Scales(a_scale, w_scale, tuple(block_shape) if block_shape else None)


def _gemm(
    a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, a_row_div, block_m, gated, activation,
    topk_weights, a_scale, w_scale, block_shape, out_dtype,
) -> torch.Tensor:
    check_gemm_operands("a", a, "w", w, "K")
    num_slots = a.shape[0] * a_row_div
    n = w.shape[1] // 2 if gated else w.shape[1]
    cfg = get_config(a.shape[0], w.shape[0], n, w.shape[2], a_row_div, a.device,
                     quant="fp8_w8a8" if a.dtype in FP8_DTYPES else None, block_shape=block_shape)
    gemm_cfg = replace(cfg.up if gated else cfg.down, block_m=block_m)  # block_m: the align's block size
    out = torch.empty((num_slots, n), dtype=out_dtype or a.dtype, device=a.device)
    routing = Routing(sorted_token_ids, expert_ids, num_tokens_post_padded, num_slots, a_row_div)
    weights = topk_weights.reshape(-1) if topk_weights is not None else None
    return invoke_moe_gemm(a, w, out, gemm_cfg, gated=gated, activation=activation, routing=routing,
                           topk_weights=weights, scales=_scales(a_scale, w_scale, block_shape))


@torch.library.custom_op("tmoe::moe_gemm_up", mutates_args=())
def moe_gemm_up(
    hidden_states: torch.Tensor, w1: torch.Tensor, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor, topk: int, block_m: int, activation: str = "silu",
    topk_weights: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None, block_shape: list[int] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """(M*topk, N) = act(x @ w1[e, :N].T) * (x @ w1[e, N:].T) per slot; ``topk_weights`` given
    scales the input side (apply_router_weight_on_input)."""
    return _gemm(hidden_states, w1, sorted_token_ids, expert_ids, num_tokens_post_padded, topk, block_m, True,
                 activation, topk_weights, a_scale, w_scale, block_shape, out_dtype)


@moe_gemm_up.register_fake
def _(hidden_states, w1, sorted_token_ids, expert_ids, num_tokens_post_padded, topk, block_m, activation="silu",
      topk_weights=None, a_scale=None, w_scale=None, block_shape=None, out_dtype=None):
    torch._check(hidden_states.shape[1] == w1.shape[2], lambda: "hidden_states and w1 disagree on K")
    torch._check(w1.shape[1] % 2 == 0, lambda: "w1 must have 2N rows")
    m = hidden_states.shape[0]
    return hidden_states.new_empty((m * topk, w1.shape[1] // 2), dtype=out_dtype or hidden_states.dtype)


@torch.library.custom_op("tmoe::moe_gemm_down", mutates_args=())
def moe_gemm_down(
    intermediate: torch.Tensor, w2: torch.Tensor, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor, block_m: int, topk_weights: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
    block_shape: list[int] | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """(M*topk, K) = intermediate[slot] @ w2[e].T, times ``topk_weights[slot]`` (float32) if given."""
    return _gemm(intermediate, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, 1, block_m, False,
                 "silu", topk_weights, a_scale, w_scale, block_shape, out_dtype)


@moe_gemm_down.register_fake
def _(intermediate, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, block_m, topk_weights=None,
      a_scale=None, w_scale=None, block_shape=None, out_dtype=None):
    torch._check(intermediate.shape[1] == w2.shape[2], lambda: "intermediate and w2 disagree on N")
    return intermediate.new_empty((intermediate.shape[0], w2.shape[1]), dtype=out_dtype or intermediate.dtype)


@torch.library.custom_op("tmoe::moe_reduce", mutates_args=())
def moe_reduce(
    y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """(M, K) = sum_t w[m, t] * y[m, t] over the slots a local expert computed."""
    return _reduce(y, topk_ids, num_experts, topk_weights, expert_map)


@moe_reduce.register_fake
def _(y, topk_ids, num_experts, topk_weights=None, expert_map=None):
    torch._check(y.dim() == 3, lambda: "y must be (M, topk, K)")
    torch._check(topk_ids.shape[0] == y.shape[0] and topk_ids.shape[1] == y.shape[1], lambda: "topk_ids shape")
    return y.new_empty((y.shape[0], y.shape[2]))


def _layer_fake(hidden_states, w1, w2, topk_weights, topk_ids):
    torch._check(hidden_states.dim() == 2 and w1.dim() == 3 and w2.dim() == 3, lambda: "bad ranks")
    torch._check(hidden_states.shape[1] == w1.shape[2], lambda: "hidden_states and w1 disagree on K")
    torch._check(w2.shape[1] == w1.shape[2] and 2 * w2.shape[2] == w1.shape[1], lambda: "w1/w2 shapes")
    torch._check(topk_ids.shape[0] == hidden_states.shape[0], lambda: "topk_ids rows")
    torch._check(topk_weights.shape == topk_ids.shape, lambda: "topk_weights shape")
    return torch.empty_like(hidden_states)


@torch.library.custom_op("tmoe::modular_forward", mutates_args=())
def modular_forward(
    hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str, global_num_experts: int, expert_map: torch.Tensor | None,
    w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, a1_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None, apply_router_weight_on_input: bool, w1_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None, handle: int,
) -> torch.Tensor:
    """The layer call of the FusedMoEModularKernel registered under ``handle``."""
    from tmoe.modular import kernel_for_handle

    args = (hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map, w1_scale,
            w2_scale, a1_scale, a2_scale, apply_router_weight_on_input, w1_bias, w2_bias)
    return kernel_for_handle(handle).run(torch.empty_like(hidden_states), *args)


@modular_forward.register_fake
def _(hidden_states, w1, w2, topk_weights, topk_ids, *args):
    return _layer_fake(hidden_states, w1, w2, topk_weights, topk_ids)


@torch.library.custom_op("tmoe::modular_forward_", mutates_args=("hidden_states",))
def modular_forward_(
    hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str, global_num_experts: int, expert_map: torch.Tensor | None,
    w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, a1_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None, apply_router_weight_on_input: bool, w1_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None, handle: int,
) -> None:
    """In-place ``modular_forward``: the output overwrites ``hidden_states``."""
    from tmoe.modular import kernel_for_handle

    args = (hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map, w1_scale,
            w2_scale, a1_scale, a2_scale, apply_router_weight_on_input, w1_bias, w2_bias)
    kernel_for_handle(handle).run(hidden_states, *args)


@modular_forward_.register_fake
def _(hidden_states, w1, w2, topk_weights, topk_ids, *args):
    _layer_fake(hidden_states, w1, w2, topk_weights, topk_ids)


def _default(quant_dtype, per_act_token_quant, per_out_ch_quant, block_shape):
    from tmoe.fused import default_kernel
    from tmoe.modular import FusedMoEQuantConfig

    return default_kernel(FusedMoEQuantConfig.from_args(quant_dtype, per_act_token_quant, per_out_ch_quant,
                                                        block_shape))


@torch.library.custom_op("tmoe::fused_experts", mutates_args=())
def fused_experts(
    hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str, global_num_experts: int, expert_map: torch.Tensor | None,
    w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, a1_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None, apply_router_weight_on_input: bool, w1_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None, quant_dtype: str | None, per_act_token_quant: bool, per_out_ch_quant: bool,
    block_shape: list[int] | None,
) -> torch.Tensor:
    """``tmoe.fused_experts``: the default modular kernel for the given quantization."""
    args = (hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map, w1_scale,
            w2_scale, a1_scale, a2_scale, apply_router_weight_on_input, w1_bias, w2_bias)
    kernel = _default(quant_dtype, per_act_token_quant, per_out_ch_quant, block_shape)
    return kernel.run(torch.empty_like(hidden_states), *args)


@fused_experts.register_fake
def _(hidden_states, w1, w2, topk_weights, topk_ids, *args):
    return _layer_fake(hidden_states, w1, w2, topk_weights, topk_ids)


@torch.library.custom_op("tmoe::fused_experts_", mutates_args=("hidden_states",))
def fused_experts_(
    hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str, global_num_experts: int, expert_map: torch.Tensor | None,
    w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, a1_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None, apply_router_weight_on_input: bool, w1_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None, quant_dtype: str | None, per_act_token_quant: bool, per_out_ch_quant: bool,
    block_shape: list[int] | None,
) -> None:
    """In-place ``fused_experts``."""
    args = (hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map, w1_scale,
            w2_scale, a1_scale, a2_scale, apply_router_weight_on_input, w1_bias, w2_bias)
    _default(quant_dtype, per_act_token_quant, per_out_ch_quant, block_shape).run(hidden_states, *args)


@fused_experts_.register_fake
def _(hidden_states, w1, w2, topk_weights, topk_ids, *args):
    _layer_fake(hidden_states, w1, w2, topk_weights, topk_ids)


@torch.library.custom_op("tmoe::topk_route", mutates_args=())
def topk_route(
    router_logits: torch.Tensor, topk: int, scoring: str = "softmax", renormalize: bool = True,
    num_expert_group: int = 0, topk_group: int = 0, e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, topk) float32 weights and int32 ids from (M, E) router logits; num_expert_group 0 = no groups."""
    return _topk_route(
        router_logits, topk, scoring=scoring, renormalize=renormalize, num_expert_group=num_expert_group or None,
        topk_group=topk_group or None, e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
    )


@topk_route.register_fake
def _(router_logits, topk, scoring="softmax", renormalize=True, num_expert_group=0, topk_group=0,
      e_score_correction_bias=None, routed_scaling_factor=1.0):
    torch._check(router_logits.dim() == 2, lambda: "router_logits must be (M, E)")
    torch._check(1 <= topk and topk <= router_logits.shape[1], lambda: "topk must be in [1, E]")
    m = router_logits.shape[0]
    new = router_logits.new_empty
    return new((m, topk), dtype=torch.float32), new((m, topk), dtype=torch.int32)


@torch.library.custom_op("tmoe::per_token_group_quant_fp8", mutates_args=())
def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int, eps: float = 1e-10, column_major_scales: bool = False, use_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) fp8 codes and (..., K // group_size) float32 scales, one per group along K."""
    return _per_token_group_quant_fp8(x, group_size, eps, column_major_scales, use_ue8m0)


@per_token_group_quant_fp8.register_fake
def _(x, group_size, eps=1e-10, column_major_scales=False, use_ue8m0=False):
    torch._check(x.dim() >= 1, lambda: "x must be (..., K)")
    torch._check(group_size >= 1 and x.shape[-1] % group_size == 0, lambda: "group_size must divide K")
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    return q, alloc_group_scales(x.shape, group_size, column_major_scales, x.device)


@torch.library.custom_op("tmoe::per_token_quant_fp8", mutates_args=())
def per_token_quant_fp8(x: torch.Tensor, eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) fp8 codes and (..., 1) float32 per-token scales."""
    return _per_token_quant_fp8(x, eps)


@per_token_quant_fp8.register_fake
def _(x, eps=1e-10):
    torch._check(x.dim() >= 1, lambda: "x must be (..., K)")
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    return q, torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)


@torch.library.custom_op("tmoe::static_quant_fp8", mutates_args=())
def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(..., K) fp8 codes of x / scale, ``scale`` one float32 element."""
    return _static_quant_fp8(x, scale)


@static_quant_fp8.register_fake
def _(x, scale):
    torch._check(x.dim() >= 1, lambda: "x must be (..., K)")
    torch._check(scale.numel() == 1, lambda: "scale must hold one element")
    return torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
