"""The stage ops ``torch.ops.tmoe.<stage>`` (align, the two GEMMs, reduce, the router; the fp8
quantization ops are in ``tmoe.ops.quant``) and their fakes. Implementations call the stage
launchers in ``tmoe.kernels``; fakes check what the launchers check (naming the argument) and
return tensors sized from static shapes only, with no branch on a symbolic size."""
from __future__ import annotations

from dataclasses import replace

import torch

from tmoe.kernels.checks import FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES, check_tensor
from tmoe.config import get_config
from tmoe.kernels.align import align_output_sizes, moe_align_block_size as _align
from tmoe.kernels.activation import Activation
from tmoe.kernels.sizes import cdiv
from tmoe.kernels.operands import (
    Routing, Scales, WeightScales, check_gemm_operands, check_low_bit_operand, operand_scales,
)
from tmoe.kernels.moe_gemm import invoke_moe_gemm
from tmoe.modular.checks import check_activation
from tmoe.modular.quant_config import FusedMoEQuantConfig
from tmoe.kernels.reduce import moe_reduce as _reduce
from tmoe.kernels.router import topk_route as _topk_route
from tmoe.ops.autograd import inference_only, register_router_autograd


@torch.library.custom_op("tmoe::moe_align_block_size", mutates_args=())
def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_map: torch.Tensor | None = None,
    num_local_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _align(topk_ids, block_size, num_experts, expert_map, num_local_experts=num_local_experts)


@moe_align_block_size.register_fake
def _(topk_ids, block_size, num_experts, expert_map=None, num_local_experts=None):
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, device=topk_ids.device)
    max_padded, num_blocks = align_output_sizes(topk_ids.numel(), block_size, num_experts)
    new = topk_ids.new_empty
    return new(max_padded, dtype=torch.int32), new(num_blocks, dtype=torch.int32), new(1, dtype=torch.int32)


def _low_bit(weight_dtype: str | None, group_size: int) -> FusedMoEQuantConfig | None:
    """The weight-only scheme of a stage GEMM (None: fp8 or unquantized weights), validated."""
    if weight_dtype is None and not group_size:
        return None
    return FusedMoEQuantConfig(weight_dtype=weight_dtype, group_size=group_size)


def _scales(a_scale: torch.Tensor | None, w_scale: torch.Tensor | None, block_shape: list[int] | None,
            w_zp: torch.Tensor | None = None,
            low_bit: FusedMoEQuantConfig | None = None) -> Scales | WeightScales | None:
    return operand_scales(a_scale, w_scale, block_shape, w_zp, low_bit and low_bit.weight_dtype,
                          low_bit.group_size if low_bit else 0, fp8=a_scale is not None or w_scale is not None,
                          missing="a_scale and w_scale must be given together for fp8 operands")


def _check_routing(a: torch.Tensor, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                   num_tokens_post_padded: torch.Tensor, block_m: int) -> None:
    """The align outputs belong together and to ``block_m``: one expert id per block of sorted ids."""
    for name, t in (("sorted_token_ids", sorted_token_ids), ("expert_ids", expert_ids),
                    ("num_tokens_post_padded", num_tokens_post_padded)):
        check_tensor(name, t, dtypes=(torch.int32,), ndim=1, device=a.device)
    if not isinstance(block_m, int) or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16 (the align block size), got {block_m!r}")
    if expert_ids.shape[0] != cdiv(sorted_token_ids.shape[0], block_m):
        raise ValueError(f"expert_ids has {expert_ids.shape[0]} blocks but sorted_token_ids "
                         f"({sorted_token_ids.shape[0]}) in blocks of block_m={block_m} needs "
                         f"{cdiv(sorted_token_ids.shape[0], block_m)}: align with block_size=block_m")


def _check_operands(a, w, a_name, w_name, k_dim, a_scale, w_scale, w_zp, low_bit) -> None:
    """``a`` (..., K_in) and ``w`` (E, rows, K_in): float or fp8 (``check_gemm_operands``), or
    low-bit codes with their scales and zero points (``low_bit``; a stays unquantized)."""
    if low_bit is None:
        check_gemm_operands(a_name, a, w_name, w, k_dim)
        if w_zp is not None:
            raise ValueError("w_zp is the zero points of int4/int8 weights; pass weight_dtype and group_size")
        return
    wd = low_bit.weight_dtype
    check_tensor(a_name, a, dtypes=FLOAT_DTYPES)
    if a_scale is not None:
        raise ValueError(f"a_scale is an fp8 activation scale; {wd} weights keep {a_name} unquantized")
    check_tensor(w_name, w, dtypes=(torch.uint8,), ndim=3, device=a.device)
    check_low_bit_operand(w_name, w, "w_scale", w_scale, "w_zp", w_zp, wd, low_bit.group_size,
                          (w.shape[0], w.shape[1], a.shape[-1]), a.device,
                          f" for {a_name} (..., {k_dim}={a.shape[-1]})")


def _check_gemm(a, w, routing, block_m, activation: Activation | None, topk_weights, num_slots, a_name, w_name,
                k_dim, topk, a_scale=None, w_scale=None, w_zp=None, low_bit=None) -> None:
    """A stage GEMM's arguments; ``activation`` given for the up GEMM (None: the down GEMM)."""
    _check_operands(a, w, a_name, w_name, k_dim, a_scale, w_scale, w_zp, low_bit)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1 or num_slots % topk:
        raise ValueError(f"topk must be a positive int dividing the {num_slots} slots, got {topk!r}")
    _check_routing(a, *routing, block_m)
    if activation is not None:
        check_activation(activation)
        if w.shape[1] % activation.rows_per_n:
            raise ValueError(f"{w_name} must be (E, 2N, K) with gate rows and up rows; got {w.shape[1]} rows")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), device=a.device)
        if topk_weights.numel() != num_slots:
            raise ValueError(f"topk_weights must hold one weight per slot ({num_slots}), got shape "
                             f"{tuple(topk_weights.shape)}")


def _up_width(activation: Activation, w1: torch.Tensor) -> int:
    """The up GEMM stage's output columns, N (this op's own inputs: no layer call checked them)."""
    return activation.intermediate_size(w1.shape[1])


def _gemm(a, w, routing, m, topk, a_row_div, block_m, activation: Activation | None, topk_weights, a_scale, w_scale,
          block_shape, out_dtype, w_zp=None, low_bit=None) -> torch.Tensor:
    """One expert GEMM with the tiles the layer uses at (M=m, E, N, K, topk); the up GEMM when
    ``activation`` is given."""
    num_slots = m * topk
    gated = activation is not None
    n_out = _up_width(activation, w) if gated else w.shape[1]
    # the layer's (N, K), from a's width (low-bit weights pack theirs): w1 (E, 2N, K), w2 (E, K, N)
    n, k = (n_out, a.shape[-1]) if gated else (a.shape[-1], w.shape[1])
    if low_bit is not None:
        quant, group_size = low_bit.quant_name, low_bit.group_size
    else:
        quant, group_size = ("fp8_w8a8" if a.dtype in FP8_DTYPES else None), None
    cfg = get_config(m, w.shape[0], n, k, topk, a.device, quant=quant, block_shape=block_shape, group_size=group_size)
    gemm_cfg = replace(cfg.up if gated else cfg.down, block_m=block_m)  # block_m: the align's block size
    out = torch.empty((num_slots, n_out), dtype=out_dtype or a.dtype, device=a.device)
    weights = topk_weights.reshape(-1) if topk_weights is not None else None
    return invoke_moe_gemm(a, w, out, gemm_cfg, gated=gated, activation=activation,
                           routing=Routing(*routing, num_slots, a_row_div), topk_weights=weights,
                           scales=_scales(a_scale, w_scale, block_shape, w_zp, low_bit))


@torch.library.custom_op("tmoe::moe_gemm_up", mutates_args=())
def moe_gemm_up(
    hidden_states: torch.Tensor, w1: torch.Tensor, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor, topk: int, block_m: int, activation: str = "silu",
    topk_weights: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None, block_shape: list[int] | None = None,
    out_dtype: torch.dtype | None = None, swiglu_alpha: float | None = None, swiglu_limit: float | None = None,
    gate_up_interleaved: bool = False, w_zp: torch.Tensor | None = None, weight_dtype: str | None = None,
    group_size: int = 0,
) -> torch.Tensor:
    """(M*topk, N) = act(x @ w1[e, :N].T) * (x @ w1[e, N:].T) per slot (a *_no_mul activation:
    act(x @ w1[e].T), w1 (E, N, K)); ``topk_weights`` given scales the input side
    (apply_router_weight_on_input); the activation options are ``LayerArgs``'s. ``weight_dtype``
    ("int4", "int8", "mxfp4") with ``group_size``: w1 holds low-bit codes, ``w_scale`` (and
    ``w_zp``) their group scales (zero points), as the layer takes them."""
    routing = (sorted_token_ids, expert_ids, num_tokens_post_padded)
    m = hidden_states.shape[0]
    act = Activation.from_args(activation, swiglu_alpha, swiglu_limit, gate_up_interleaved)
    low_bit = _low_bit(weight_dtype, group_size)
    _check_gemm(hidden_states, w1, routing, block_m, act, topk_weights, m * topk, "hidden_states", "w1", "K",
                topk, a_scale=a_scale, w_scale=w_scale, w_zp=w_zp, low_bit=low_bit)
    return _gemm(hidden_states, w1, routing, m, topk, topk, block_m, act, topk_weights, a_scale,
                 w_scale, block_shape, out_dtype, w_zp, low_bit)


@moe_gemm_up.register_fake
def _(hidden_states, w1, sorted_token_ids, expert_ids, num_tokens_post_padded, topk, block_m, activation="silu",
      topk_weights=None, a_scale=None, w_scale=None, block_shape=None, out_dtype=None, swiglu_alpha=None,
      swiglu_limit=None, gate_up_interleaved=False, w_zp=None, weight_dtype=None, group_size=0):
    m = hidden_states.shape[0]
    act = Activation.from_args(activation, swiglu_alpha, swiglu_limit, gate_up_interleaved)
    _check_gemm(hidden_states, w1, (sorted_token_ids, expert_ids, num_tokens_post_padded), block_m, act,
                topk_weights, m * topk, "hidden_states", "w1", "K", topk, a_scale, w_scale, w_zp,
                _low_bit(weight_dtype, group_size))
    return hidden_states.new_empty((m * topk, _up_width(act, w1)), dtype=out_dtype or hidden_states.dtype)


@torch.library.custom_op("tmoe::moe_gemm_down", mutates_args=())
def moe_gemm_down(
    intermediate: torch.Tensor, w2: torch.Tensor, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor, topk: int, block_m: int, topk_weights: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
    block_shape: list[int] | None = None, out_dtype: torch.dtype | None = None, w_zp: torch.Tensor | None = None,
    weight_dtype: str | None = None, group_size: int = 0,
) -> torch.Tensor:
    """(M*topk, K) = intermediate[slot] @ w2[e].T, times ``topk_weights[slot]`` (float32) if given;
    ``topk`` picks the layer's tiles (intermediate has M*topk rows). ``weight_dtype``/``group_size``/
    ``w_zp``: low-bit w2 codes, as in ``moe_gemm_up``."""
    routing = (sorted_token_ids, expert_ids, num_tokens_post_padded)
    num_slots = intermediate.shape[0]
    low_bit = _low_bit(weight_dtype, group_size)
    _check_gemm(intermediate, w2, routing, block_m, None, topk_weights, num_slots, "intermediate", "w2", "N", topk,
                a_scale=a_scale, w_scale=w_scale, w_zp=w_zp, low_bit=low_bit)
    return _gemm(intermediate, w2, routing, num_slots // topk, topk, 1, block_m, None, topk_weights,
                 a_scale, w_scale, block_shape, out_dtype, w_zp, low_bit)


@moe_gemm_down.register_fake
def _(intermediate, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk, block_m, topk_weights=None,
      a_scale=None, w_scale=None, block_shape=None, out_dtype=None, w_zp=None, weight_dtype=None, group_size=0):
    _check_gemm(intermediate, w2, (sorted_token_ids, expert_ids, num_tokens_post_padded), block_m, None,
                topk_weights, intermediate.shape[0], "intermediate", "w2", "N", topk, a_scale=a_scale,
                w_scale=w_scale, w_zp=w_zp, low_bit=_low_bit(weight_dtype, group_size))
    return intermediate.new_empty((intermediate.shape[0], w2.shape[1]), dtype=out_dtype or intermediate.dtype)


@torch.library.custom_op("tmoe::moe_reduce", mutates_args=())
def moe_reduce(
    y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None, num_local_experts: int | None = None,
) -> torch.Tensor:
    """(M, K) = sum_t w[m, t] * y[m, t] over the slots a local expert computed."""
    return _reduce(y, topk_ids, num_experts, topk_weights, expert_map, num_local_experts=num_local_experts)


@moe_reduce.register_fake
def _(y, topk_ids, num_experts, topk_weights=None, expert_map=None, num_local_experts=None):
    check_tensor("y", y, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, ndim=2, device=y.device)
    if tuple(topk_ids.shape) != tuple(y.shape[:2]):
        raise ValueError(f"topk_ids must have shape (M, topk) = {tuple(y.shape[:2])} like y, got {tuple(topk_ids.shape)}")
    for name, t in (("topk_weights", topk_weights), ("expert_map", expert_map)):
        if t is not None:
            check_tensor(name, t, device=y.device)
    return y.new_empty((y.shape[0], y.shape[2]))


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
    check_tensor("router_logits", router_logits, dtypes=FLOAT_DTYPES, ndim=2)
    if e_score_correction_bias is not None:
        check_tensor("e_score_correction_bias", e_score_correction_bias, dtypes=(torch.float32,), ndim=1,
                     device=router_logits.device)
    e = router_logits.shape[1]
    if not 1 <= topk <= e:
        raise ValueError(f"topk must be in [1, E={e}] (router_logits is (M, E)), got {topk}")
    m = router_logits.shape[0]
    new = router_logits.new_empty
    return new((m, topk), dtype=torch.float32), new((m, topk), dtype=torch.int32)


for _op in (moe_gemm_up, moe_gemm_down, moe_reduce):
    inference_only(_op)
register_router_autograd(topk_route)
