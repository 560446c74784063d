"""The backward stage ops ``torch.ops.tmoe.moe_grad_*``, ``topk_route_grad`` and the all-gather
expert parallelism's collectives (``ep_all_gather``, ``ep_reduce_scatter``), with their fakes.

The layer op's autograd formula (``tmoe.ops.autograd``) calls them, so AOTAutograd traces the
backward into the same graph as the forward. Shapes come from static sizes only; the block size
of the backward's align is an argument, a pure function of the expert count (``grad_block_m``,
computed by the autograd formula); each op picks its tiles inside its body and fake
(``tmoe.config.backward``), as the forward ops do, never in code that dynamo traces."""
from __future__ import annotations

import torch

from tmoe.config.backward import act_tiles, grad_act_blocks, input_tiles, weight_tiles
from tmoe.kernels.align import align_output_sizes, moe_align_block_size
from tmoe.kernels.checks import INDEX_DTYPES, check_shape, check_tensor
from tmoe.kernels.activation import Activation
from tmoe.kernels.grad_checks import check_grad_act, check_grad_input, check_grad_weight, check_preact
from tmoe.kernels.lora import LoraOperands
from tmoe.kernels.moe_grad_act import moe_grad_act as _grad_act
from tmoe.kernels.moe_grad_bias import moe_grad_bias as _grad_bias
from tmoe.kernels.moe_grad_input import moe_grad_input as _grad_input
from tmoe.kernels.moe_grad_weight import moe_grad_weight as _grad_weight
from tmoe.kernels.operands import BlockScales, WeightScales, check_low_bit_operand, codes_per_byte, logical_cols
from tmoe.kernels.router_grad import topk_route_grad as _topk_route_grad


@torch.library.custom_op("tmoe::moe_grad_align", mutates_args=())
def moe_grad_align(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, expert_map: torch.Tensor | None = None,
    num_local_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded, expert_offsets (E + 1,)) of
    ``moe_align_block_size`` at the backward's block size ``block_m``."""
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=topk_ids.device)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(
        topk_ids, block_m, num_experts, expert_map, offsets, num_local_experts=num_local_experts)
    return sorted_ids, expert_ids, num_post_padded, offsets


@moe_grad_align.register_fake
def _(topk_ids, block_m, num_experts, expert_map=None, num_local_experts=None):
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES)
    max_padded, num_blocks = align_output_sizes(topk_ids.numel(), block_m, num_experts)
    new = topk_ids.new_empty
    return (new(max_padded, dtype=torch.int32), new(num_blocks, dtype=torch.int32), new(1, dtype=torch.int32),
            new(num_experts + 1, dtype=torch.int32))


@torch.library.custom_op("tmoe::moe_grad_act", mutates_args=())
def moe_grad_act(
    grad_out: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor, block_m: int,
    w1_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, activation: str, swiglu_alpha: float | None,
    swiglu_limit: float | None, gate_up_interleaved: bool, apply_router_weight_on_input: bool,
    w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None, block_shape: list[int] | None = None,
    preact: torch.Tensor | None = None, w2_lora_u: torch.Tensor | None = None, w2_lora_a: torch.Tensor | None = None,
    lora_scale: float = 1.0, w1_lora_t: torch.Tensor | None = None, w1_lora_b: torch.Tensor | None = None,
    weight_dtype: str | None = None, group_size: int = 0, w2_zp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h (P, 2N), inter (P, N), partial (P, parts) float32): see ``tmoe.kernels.moe_grad_act``;
    frozen block-fp8 w1/w2 come with their ``w1_scale``/``w2_scale`` and ``block_shape``;
    ``preact`` (M * topk, 2N): the forward's saved pre-activation (None: recomputed). w2's LoRA
    adapter (with ``preact``): ``w2_lora_u`` (M * topk, r) = grad_out @ w2_lora_b[e] per slot
    (``moe_lora_token_rows``) and ``w2_lora_a`` (E, r, N): g takes lora_scale * u @ a[e]. w1's
    adapter, when the pre-activation is recomputed (no ``preact``): ``w1_lora_t`` (M * topk, r) =
    x @ w1_lora_a[e].T per slot and ``w1_lora_b`` (E, 2N, r): the recomputed x @ w1.T takes
    lora_scale * t @ b[e].T. Frozen weight-only low-bit experts (``weight_dtype`` int4, int8 or
    mxfp4, ``group_size``): w1/w2 their codes, ``w2_scale`` (and ``w2_zp``) w2's group scales (and
    zero points), dequantized in g's K loop; they need ``preact`` (w1 is not read)."""
    act, scales = _grad_act_operands(grad_out, x, w1, w2, topk_weights, sorted_token_ids, expert_ids,
                                     num_tokens_post_padded, w1_bias, w2_bias, activation, swiglu_alpha, swiglu_limit,
                                     gate_up_interleaved, w1_scale, w2_scale, block_shape, preact, weight_dtype,
                                     group_size, w2_zp)
    lora = _lora_operands("w2", w2_lora_u, w2_lora_a, lora_scale, topk_weights.numel())
    lora_pre = _lora_pre(w1_lora_t, w1_lora_b, lora_scale, topk_weights.numel(), preact)
    return _grad_act(grad_out, x, w1, w2, topk_weights, topk_weights.shape[1], sorted_token_ids, expert_ids,
                     num_tokens_post_padded, activation=act, block_m=block_m, tiles=act_tiles(block_m),
                     apply_router_weight_on_input=apply_router_weight_on_input, w1_bias=w1_bias, w2_bias=w2_bias,
                     weight_scales=scales if isinstance(scales, BlockScales) else None, preact=preact, lora=lora,
                     lora_pre=lora_pre, w2_low_bit=scales if isinstance(scales, WeightScales) else None)


def _lora_pre(t: torch.Tensor | None, b: torch.Tensor | None, scale: float, rows: int,
              preact: torch.Tensor | None) -> LoraOperands | None:
    """w1's adapter term of the recomputed pre-activation from ``w1_lora_t`` (rows, r) and
    ``w1_lora_b`` (E, 2N, r) (checked), or None (also with a saved ``preact``, which holds it)."""
    if t is None and b is None:
        return None
    if t is None or b is None or preact is not None:
        raise ValueError("w1_lora_t and w1_lora_b go together, and only without a saved preact")
    check_tensor("w1_lora_t", t, ndim=2, device=b.device)
    check_tensor("w1_lora_b", b, dtypes=(t.dtype,), ndim=3)
    check_shape("w1_lora_t", t, (rows, b.shape[2]))
    return LoraOperands(t, b, scale)


def _lora_operands(weight: str, u: torch.Tensor | None, a: torch.Tensor | None, scale: float,
                   rows: int) -> LoraOperands | None:
    """A backward GEMM's LoRA term from the op's arguments ``{weight}_lora_u`` (rows, r) and
    ``{weight}_lora_a`` (E, r, C) (checked), or None."""
    if u is None and a is None:
        return None
    if u is None or a is None:
        raise ValueError(f"{weight}_lora_u and {weight}_lora_a must be given together")
    check_tensor(f"{weight}_lora_u", u, ndim=2, device=a.device)
    check_tensor(f"{weight}_lora_a", a, dtypes=(u.dtype,), ndim=3)
    check_shape(f"{weight}_lora_u", u, (rows, a.shape[1]))
    return LoraOperands(u, a.transpose(1, 2), scale)


def _grad_act_operands(grad_out, x, w1, w2, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                       w1_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, gate_up_interleaved, w1_scale,
                       w2_scale, block_shape, preact, weight_dtype=None, group_size=0,
                       w2_zp=None) -> tuple[Activation, BlockScales | WeightScales | None]:
    """``moe_grad_act``'s checks (op and fake): its ``Activation`` from the schema arguments, and the
    frozen weights' scales: block fp8 (``BlockScales``), w2's low-bit ones (``WeightScales``), or
    None for float weights."""
    act = Activation.from_args(activation, swiglu_alpha, swiglu_limit, gate_up_interleaved)
    pack = codes_per_byte(weight_dtype)
    check_grad_act(grad_out, x, w1, w2, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, w1_bias,
                   w2_bias, act, pack)
    check_preact(preact, x, w1, topk_weights)
    if weight_dtype is None:
        return act, BlockScales.of(w1, w2, w1_scale, w2_scale, block_shape)
    if preact is None:
        raise ValueError("moe_grad_act with low-bit weights reads the forward's saved pre-activation (preact)")
    e, k, n = w2.shape[0], x.shape[1], logical_cols(w2, weight_dtype)
    check_low_bit_operand("w2", w2, "w2_scale", w2_scale, "w2_zp", w2_zp, weight_dtype, group_size, (e, k, n), x.device)
    return act, WeightScales(weight_dtype, w2_scale, w2_zp, group_size)


@moe_grad_act.register_fake
def _(grad_out, x, w1, w2, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, block_m, w1_bias,
      w2_bias, activation, swiglu_alpha, swiglu_limit, gate_up_interleaved, apply_router_weight_on_input,
      w1_scale=None, w2_scale=None, block_shape=None, preact=None, w2_lora_u=None, w2_lora_a=None, lora_scale=1.0,
      w1_lora_t=None, w1_lora_b=None, weight_dtype=None, group_size=0, w2_zp=None):
    _grad_act_operands(grad_out, x, w1, w2, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                       w1_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, gate_up_interleaved, w1_scale,
                       w2_scale, block_shape, preact, weight_dtype, group_size, w2_zp)
    _lora_operands("w2", w2_lora_u, w2_lora_a, lora_scale, topk_weights.numel())
    _lora_pre(w1_lora_t, w1_lora_b, lora_scale, topk_weights.numel(), preact)
    p, n = sorted_token_ids.shape[0], logical_cols(w2, weight_dtype)
    new = x.new_empty
    return new((p, w1.shape[1])), new((p, n)), new((p, grad_act_blocks(n, block_m)), dtype=torch.float32)


@torch.library.custom_op("tmoe::moe_grad_input", mutates_args=())
def moe_grad_input(
    grad_h: torch.Tensor, w1: torch.Tensor, partial: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor, block_m: int, num_experts: int, expert_map: torch.Tensor | None,
    num_local_experts: int | None, apply_router_weight_on_input: bool, w1_scale: torch.Tensor | None = None,
    block_shape: list[int] | None = None, w1_lora_u: torch.Tensor | None = None,
    w1_lora_a: torch.Tensor | None = None, lora_scale: float = 1.0, weight_dtype: str | None = None,
    group_size: int = 0, w1_zp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x (M, K), grad_topk_weights (M, topk) float32): see ``tmoe.kernels.moe_grad_input``;
    a frozen block-fp8 w1 comes with its ``w1_scale`` and ``block_shape``; w1's LoRA adapter:
    ``w1_lora_u`` (P, r) = grad_h @ w1_lora_b[e] in aligned rows (``moe_lora_aligned_rows``) and
    ``w1_lora_a`` (E, r, K): each slot's dx takes lora_scale * u @ a[e]. Frozen weight-only low-bit
    w1 (``weight_dtype``, ``group_size``): its codes with ``w1_scale`` (and ``w1_zp``), dequantized
    in the K loop."""
    check_grad_input(grad_h, w1, partial, topk_weights, topk_ids, sorted_token_ids, expert_ids, num_tokens_post_padded)
    lora = _lora_operands("w1", w1_lora_u, w1_lora_a, lora_scale, grad_h.shape[0])
    return _grad_input(grad_h, w1, partial, topk_weights, topk_ids, sorted_token_ids, expert_ids,
                       num_tokens_post_padded, num_experts, expert_map=expert_map,
                       num_local_experts=num_local_experts, apply_router_weight_on_input=apply_router_weight_on_input,
                       block_m=block_m, tiles=input_tiles(topk_ids.shape[0]),
                       weight_scales=_w1_scales(w1, w1_scale, block_shape, weight_dtype, group_size, w1_zp), lora=lora)


def _w1_scales(w1: torch.Tensor, w1_scale: torch.Tensor | None, block_shape: list[int] | None,
               weight_dtype: str | None = None, group_size: int = 0,
               w1_zp: torch.Tensor | None = None) -> BlockScales | WeightScales | None:
    """w1's scales (checked) for ``moe_grad_input``, which reads no w2: block fp8's, or low-bit
    codes' group scales and zero points."""
    if weight_dtype is None:
        return BlockScales.of(w1, w1, w1_scale, w1_scale, block_shape)
    shape = (w1.shape[0], w1.shape[1], logical_cols(w1, weight_dtype))
    check_low_bit_operand("w1", w1, "w1_scale", w1_scale, "w1_zp", w1_zp, weight_dtype, group_size, shape, w1.device)
    return WeightScales(weight_dtype, w1_scale, w1_zp, group_size)


@moe_grad_input.register_fake
def _(grad_h, w1, partial, topk_weights, topk_ids, sorted_token_ids, expert_ids, num_tokens_post_padded, block_m,
      num_experts, expert_map, num_local_experts, apply_router_weight_on_input, w1_scale=None, block_shape=None,
      w1_lora_u=None, w1_lora_a=None, lora_scale=1.0, weight_dtype=None, group_size=0, w1_zp=None):
    check_grad_input(grad_h, w1, partial, topk_weights, topk_ids, sorted_token_ids, expert_ids, num_tokens_post_padded)
    _w1_scales(w1, w1_scale, block_shape, weight_dtype, group_size, w1_zp)
    _lora_operands("w1", w1_lora_u, w1_lora_a, lora_scale, grad_h.shape[0])
    m, topk = topk_ids.shape
    k = logical_cols(w1, weight_dtype)
    return grad_h.new_empty((m, k)), grad_h.new_empty((m, topk), dtype=torch.float32)


@torch.library.custom_op("tmoe::moe_grad_weight", mutates_args=())
def moe_grad_weight(
    left: torch.Tensor, right: torch.Tensor, topk_weights: torch.Tensor, sorted_token_ids: torch.Tensor,
    expert_offsets: torch.Tensor, num_local_experts: int, tokens_left: bool, scale_tokens: bool, block_m: int,
    expert_map: torch.Tensor | None, transposed: bool = False,
) -> torch.Tensor:
    """dW (E_local, P_DIM, Q_DIM): see ``tmoe.kernels.moe_grad_weight`` (``block_m``: the block size
    of the align that made ``sorted_token_ids`` and ``expert_offsets``; ``transposed``: strided as the
    transpose of a contiguous (E_local, Q_DIM, P_DIM))."""
    _check_block_m(block_m)
    check_grad_weight(left, right, topk_weights, sorted_token_ids, expert_offsets, tokens_left, expert_map)
    return _grad_weight(left, right, topk_weights, sorted_token_ids, expert_offsets, num_local_experts,
                        tokens_left=tokens_left, scale_tokens=scale_tokens, row_align=block_m,
                        tiles=weight_tiles(topk_weights.numel(), expert_offsets.shape[0] - 1), expert_map=expert_map,
                        transposed=transposed)


@moe_grad_weight.register_fake
def _(left, right, topk_weights, sorted_token_ids, expert_offsets, num_local_experts, tokens_left, scale_tokens,
      block_m, expert_map, transposed=False):
    _check_block_m(block_m)
    check_grad_weight(left, right, topk_weights, sorted_token_ids, expert_offsets, tokens_left, expert_map)
    p_dim, q_dim = left.shape[1], right.shape[1]
    if transposed:
        return left.new_empty((num_local_experts, q_dim, p_dim)).transpose(1, 2)
    return left.new_empty((num_local_experts, p_dim, q_dim))


def _check_block_m(block_m: int) -> None:
    """An align block is a positive power of two (the TMA path tiles each expert's run by it)."""
    if not isinstance(block_m, int) or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be the align's block size, a power of two; got {block_m}")


@torch.library.custom_op("tmoe::moe_grad_bias", mutates_args=())
def moe_grad_bias(
    left: torch.Tensor, topk_weights: torch.Tensor, sorted_token_ids: torch.Tensor, expert_offsets: torch.Tensor,
    num_local_experts: int, tokens_left: bool, weighted: bool, expert_map: torch.Tensor | None,
) -> torch.Tensor:
    """db (E_local, P_DIM): see ``tmoe.kernels.moe_grad_weight.moe_grad_bias``."""
    check_grad_weight(left, None, topk_weights, sorted_token_ids, expert_offsets, tokens_left, expert_map)
    return _grad_bias(left, topk_weights, sorted_token_ids, expert_offsets, num_local_experts,
                      tokens_left=tokens_left, weighted=weighted, expert_map=expert_map)


@moe_grad_bias.register_fake
def _(left, topk_weights, sorted_token_ids, expert_offsets, num_local_experts, tokens_left, weighted, expert_map):
    check_grad_weight(left, None, topk_weights, sorted_token_ids, expert_offsets, tokens_left, expert_map)
    return left.new_empty((num_local_experts, left.shape[1]))


@torch.library.custom_op("tmoe::topk_route_grad", mutates_args=())
def topk_route_grad(
    grad_weights: torch.Tensor, router_logits: torch.Tensor, topk_ids: torch.Tensor, scoring: str,
    renormalize: bool, routed_scaling_factor: float,
) -> torch.Tensor:
    """(M, E) gradient of the router logits: see ``tmoe.kernels.router_grad``."""
    return _topk_route_grad(grad_weights, router_logits, topk_ids, scoring=scoring, renormalize=renormalize,
                            routed_scaling_factor=routed_scaling_factor)


@topk_route_grad.register_fake
def _(grad_weights, router_logits, topk_ids, scoring, renormalize, routed_scaling_factor):
    return torch.empty_like(router_logits, memory_format=torch.contiguous_format)
