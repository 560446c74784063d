"""Autograd formulas of the ops: the layer op's and the router's backward (through the backward
ops of ``tmoe.ops.backward``, so AOTAutograd traces them), and a clear error for the stage ops,
which stay inference-only."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._library.custom_ops import CustomOpDef

from tmoe.config.backward import grad_block_m
from tmoe.kernels.checks import compile_visible
from tmoe.kernels.gemm_args import stored_transposed
from tmoe.kernels.grad_checks import check_first_order
from tmoe.modular.alltoall import kept_slot_ids
from tmoe.modular.call import LayerArgs
from tmoe.modular.checks import check_layer_call, low_bit_needs_saved_preactivation
from tmoe.modular.kernel import split_op_args
from tmoe.ops import backward, collectives, lora_rows  # noqa: F401  (register the backward's ops)

_INDEX = {name: i for i, name in enumerate(LayerArgs._fields)}


def inference_only(op: CustomOpDef) -> None:
    """Register a backward for ``op`` that raises a clear error (the forward still records a grad_fn)."""
    name = op._qualname

    def backward(ctx, *grads):
        raise RuntimeError(f"{name} is a stage op without a backward; train through the layer "
                           "(tmoe.fused_experts, FusedMoEModularKernel, FusedMoE), or detach its inputs")

    op.register_autograd(backward)


def _layer_setup(ctx, inputs: tuple, output: torch.Tensor, preact: torch.Tensor | None = None) -> None:
    """Save what the backward reads: the call's ``MoEProblem`` and tensors; ``preact``: the forward's
    saved pre-activation (``tmoe::modular_forward_train``), else None (the backward recomputes it)."""
    call, spec = split_op_args(inputs)
    spec.check_trainable(call)
    ctx.num_inputs = len(inputs)
    ctx.problem = check_layer_call(call, spec.quant)
    # expert parallelism: the backward gathers x, routing and grad_out of every rank, and sums the
    # input and router gradients back to the ranks that own the tokens. All-to-all: each rank pads
    # its tokens to max_tokens_per_rank first, and the slots the dispatch dropped take no gradient.
    pf, pf_args = spec.prepare_finalize, spec.prepare_finalize_args
    ctx.group = spec.group_name if pf in ("allgather", "alltoall") else ""
    ctx.alltoall = (pf_args[0], pf_args[2]) if pf == "alltoall" else None  # (max_tokens_per_rank, capacity)
    ctx.scheme = spec.quant.dtype_name or spec.quant.weight_dtype
    # frozen block-fp8 experts (QLoRA-style): the backward dequantizes the weights in its kernels
    block_shape = spec.quant.block_shape if spec.quant.quant_dtype is not None else None
    ctx.block_shape = list(block_shape) if block_shape else None
    # frozen weight-only low-bit experts (QLoRA): dX's and g's GEMMs dequantize the codes; the
    # pre-activation is the forward's saved one (refused before any launch without it)
    ctx.weight_dtype, ctx.group_size = spec.quant.weight_dtype, spec.quant.group_size
    if ctx.weight_dtype is not None and preact is None:
        raise NotImplementedError(low_bit_needs_saved_preactivation(ctx.weight_dtype))
    ctx.on_input = call.apply_router_weight_on_input
    ctx.lora_scale = 1.0 if call.lora_scale is None else call.lora_scale
    ctx.save_for_backward(call.hidden_states, call.w1, call.w2, call.topk_weights, call.topk_ids, call.expert_map,
                          call.w1_bias, call.w2_bias, call.w1_scale, call.w2_scale, preact, call.w1_lora_a,
                          call.w1_lora_b, call.w2_lora_a, call.w2_lora_b, call.w1_zp, call.w2_zp)


def _train_setup(ctx, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    _layer_setup(ctx, inputs, output[0], output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero gradient for preact (M * topk * 2N values) in the backward


def _layer_backward(ctx, grad_out: torch.Tensor) -> tuple:
    """dx, dw1, dw2, dtopk_weights, db1, db2 of the layer: the intermediate's gradient with the
    activation's derivative fused (the pre-activation read from the forward's save, else recomputed
    from x), then the input and weight GEMMs. Weight gradients run only for weights that require
    grad (frozen experts skip them)."""
    check_first_order()
    if ctx.scheme is not None and ctx.block_shape is None and ctx.weight_dtype is None:
        raise NotImplementedError(f"gradients through frozen quantized experts ({ctx.scheme}) are not supported yet "
                                  "(block fp8 and weight-only low-bit are): run the quantized layer under "
                                  "torch.no_grad(), or train float experts")
    (x, w1, w2, topk_weights, topk_ids, expert_map, w1_bias, w2_bias, w1_scale, w2_scale, preact, a1, b1, a2,
     b2, w1_zp, w2_zp) = ctx.saved_tensors
    low_bit = dict(weight_dtype=ctx.weight_dtype, group_size=ctx.group_size)  # None, 0: not low-bit
    problem, on_input, needs = ctx.problem, ctx.on_input, ctx.needs_input_grad
    act, e_local, num_experts = problem.activation, problem.num_local_experts, problem.num_experts
    num_local = e_local if expert_map is not None else None
    tmoe = torch.ops.tmoe
    m = x.shape[0]
    if ctx.alltoall:  # ranks pass up to max_tokens_per_rank tokens: pad to it (routing -1: no slot)
        pad = ctx.alltoall[0] - m
        x, topk_weights, grad_out = (F.pad(t, (0, 0, 0, pad)) for t in (x, topk_weights, grad_out))
        topk_ids = F.pad(topk_ids, (0, 0, 0, pad), value=-1)
    if ctx.group:
        x, topk_weights, topk_ids, grad_out = (tmoe.ep_all_gather(t, ctx.group)
                                               for t in (x, topk_weights, topk_ids, grad_out))
    if ctx.alltoall:
        topk_ids = kept_slot_ids(topk_ids, ctx.alltoall[0], ctx.alltoall[1], num_experts)
    topk_weights = topk_weights.contiguous()
    block_m = grad_block_m(num_experts)
    sorted_ids, expert_ids, num_post_padded, offsets = tmoe.moe_grad_align(
        topk_ids.contiguous(), block_m=block_m, num_experts=num_experts, expert_map=expert_map,
        num_local_experts=num_local)
    activation, swiglu_alpha, swiglu_limit, gate_up_interleaved = act.as_args()
    align = dict(sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_padded=num_post_padded,
                 block_m=block_m)
    scale = ctx.lora_scale
    # w2's adapter: u2 = grad_out @ b2[e] per slot, read by g's GEMM (g = go @ (w2 + s b2 a2)) and dA2
    slot_rows = dict(topk_ids=topk_ids, num_experts=num_experts, expert_map=expert_map, num_local_experts=num_local)
    u2 = tmoe.moe_lora_token_rows(grad_out, b2.transpose(1, 2), **slot_rows) if a2 is not None else None
    # w1's adapter: t1 = x @ a1[e].T per slot, for the recomputed pre-activation (no saved one) and dB1
    t1 = None
    if a1 is not None and (preact is None or needs[_INDEX["w1_lora_b"]]):
        t1 = tmoe.moe_lora_token_rows(x, a1, **slot_rows)
    grad_h, inter, partial = tmoe.moe_grad_act(
        grad_out, x, w1, w2, topk_weights, sorted_token_ids=sorted_ids, expert_ids=expert_ids,
        num_tokens_post_padded=num_post_padded, block_m=block_m, w1_bias=w1_bias, w2_bias=w2_bias,
        activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
        gate_up_interleaved=gate_up_interleaved, apply_router_weight_on_input=on_input, w1_scale=w1_scale,
        w2_scale=w2_scale, block_shape=ctx.block_shape, preact=preact, w2_lora_u=u2, w2_lora_a=a2, lora_scale=scale,
        w1_lora_t=t1 if preact is None else None, w1_lora_b=b1 if preact is None and a1 is not None else None,
        w2_zp=w2_zp, **low_bit)
    grads: list[torch.Tensor | None] = [None] * ctx.num_inputs
    expert_rows = dict(sorted_ids=sorted_ids, offsets=offsets, block_m=block_m, e_local=e_local, expert_map=expert_map)
    rows = dict(topk_weights=topk_weights, **expert_rows)
    # Each workspace is released once its last reader ran (the peak holds the gradients and grad_h
    # only): dW2 = sum go^T (w a) first (inter holds w a; a alone when the forward scaled the input)
    _weight_grads(grads, needs, "w2", "w2_bias", w2_bias is not None, left=grad_out, right=inter, tokens_left=True,
                  scale_tokens=False, weighted_bias=not on_input, transposed=stored_transposed(w2), **rows)
    if a2 is not None:  # dB2 = s sum go^T (inter @ a2[e].T), dA2 = s sum u2^T inter
        if needs[_INDEX["w2_lora_b"]]:
            t2 = tmoe.moe_lora_aligned_rows(inter, a2.transpose(1, 2), **align, num_slots=topk_weights.numel())
            grads[_INDEX["w2_lora_b"]] = _lora_grad(grad_out, t2, topk_weights, True, False, b2, scale,
                                                    **expert_rows)
        if needs[_INDEX["w2_lora_a"]]:
            grads[_INDEX["w2_lora_a"]] = _lora_grad(u2, inter, topk_weights.view(-1, 1), True, False, a2, scale,
                                                    **expert_rows)
    del inter, u2
    # w1's adapter: u1 = grad_h @ b1[e] in aligned rows, read by dx's GEMM (dx = dh @ (w1 + s b1 a1)) and dA1
    u1 = tmoe.moe_lora_aligned_rows(grad_h, b1, **align, num_slots=topk_weights.numel()) if a1 is not None else None
    if needs[_INDEX["hidden_states"]] or needs[_INDEX["topk_weights"]]:
        grad_x, grad_w = tmoe.moe_grad_input(
            grad_h, w1, partial, topk_weights, topk_ids, sorted_token_ids=sorted_ids, expert_ids=expert_ids,
            num_tokens_post_padded=num_post_padded, block_m=block_m, num_experts=num_experts, expert_map=expert_map,
            num_local_experts=num_local, apply_router_weight_on_input=on_input, w1_scale=w1_scale,
            block_shape=ctx.block_shape, w1_lora_u=u1, w1_lora_a=a1, lora_scale=scale,
            w1_zp=w1_zp, **low_bit)
        if ctx.group:  # each rank's tokens collect their slots' gradients from every rank's experts
            grad_x = tmoe.ep_reduce_scatter(grad_x, ctx.group)[:m].to(grad_x.dtype)
            grad_w = tmoe.ep_reduce_scatter(grad_w, ctx.group)[:m]
        grads[_INDEX["hidden_states"]], grads[_INDEX["topk_weights"]] = grad_x, grad_w
    del partial
    # dW1[e] = sum dh^T x (x times the router weight when the forward scaled the input)
    _weight_grads(grads, needs, "w1", "w1_bias", w1_bias is not None, left=grad_h, right=x, tokens_left=False,
                  scale_tokens=on_input, weighted_bias=False, transposed=stored_transposed(w1), **rows)
    if a1 is not None:  # dA1 = s sum u1^T x, dB1 = s sum dh^T (x @ a1[e].T) (x times the weight on input)
        if needs[_INDEX["w1_lora_a"]]:
            grads[_INDEX["w1_lora_a"]] = _lora_grad(u1, x, topk_weights, False, on_input, a1, scale, **expert_rows)
        if needs[_INDEX["w1_lora_b"]]:
            grads[_INDEX["w1_lora_b"]] = _lora_grad(grad_h, t1, topk_weights.view(-1, 1), False, on_input, b1, scale,
                                                    **expert_rows)
    return tuple(grads)


def _lora_grad(left: torch.Tensor, right: torch.Tensor, topk_weights: torch.Tensor, tokens_left: bool,
               scale_tokens: bool, factor: torch.Tensor, scale, *, sorted_ids: torch.Tensor, offsets: torch.Tensor,
               block_m: int, e_local: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """A LoRA factor's gradient: scale * sum over each expert's rows of left^T right (one K-grouped
    GEMM, ``moe_grad_weight``; the token operand a slot tensor where ``topk_weights`` is (slots, 1))."""
    grad = torch.ops.tmoe.moe_grad_weight(
        left, right, topk_weights, sorted_token_ids=sorted_ids, expert_offsets=offsets, num_local_experts=e_local,
        tokens_left=tokens_left, scale_tokens=scale_tokens, block_m=block_m, expert_map=expert_map,
        transposed=stored_transposed(factor))
    return grad if scale == 1.0 else grad * scale


def _weight_grads(grads: list, needs: tuple, weight: str, bias: str, has_bias: bool, *, left: torch.Tensor,
                  right: torch.Tensor, topk_weights: torch.Tensor, sorted_ids: torch.Tensor, offsets: torch.Tensor,
                  block_m: int, e_local: int, tokens_left: bool, scale_tokens: bool, weighted_bias: bool,
                  expert_map: torch.Tensor | None, transposed: bool) -> None:
    """Fill the gradients of ``weight`` (one K-grouped GEMM) and of its ``bias`` (a sum over the same
    rows), each only if it requires grad: a frozen weight with a trainable bias runs no GEMM.
    ``transposed``: the weight is stored transposed, and its gradient is written in that layout, so
    the parameter takes it without a transposing copy."""
    tmoe = torch.ops.tmoe
    if needs[_INDEX[weight]]:
        grads[_INDEX[weight]] = tmoe.moe_grad_weight(
            left, right, topk_weights, sorted_token_ids=sorted_ids, expert_offsets=offsets, num_local_experts=e_local,
            tokens_left=tokens_left, scale_tokens=scale_tokens, block_m=block_m, expert_map=expert_map,
            transposed=transposed)
    if has_bias and needs[_INDEX[bias]]:
        grads[_INDEX[bias]] = tmoe.moe_grad_bias(
            left, topk_weights, sorted_token_ids=sorted_ids, expert_offsets=offsets, num_local_experts=e_local,
            tokens_left=tokens_left, weighted=weighted_bias, expert_map=expert_map)


def register_layer_autograd(op: CustomOpDef) -> None:
    """The layer op's backward (``LayerArgs`` differentiable in hidden_states, w1, w2,
    topk_weights, w1_bias, w2_bias)."""
    op.register_autograd(_layer_backward, setup_context=compile_visible(_layer_setup))


def _train_backward(ctx, grad_out: torch.Tensor, grad_preact: torch.Tensor | None) -> tuple:
    return _layer_backward(ctx, grad_out)


def register_train_autograd(op: CustomOpDef) -> None:
    """The backward of ``tmoe::modular_forward_train``: the layer's, reading the saved
    pre-activation (the op's second output, not differentiable)."""
    op.register_autograd(_train_backward, setup_context=compile_visible(_train_setup))


def _router_setup(ctx, inputs: tuple, output: tuple) -> None:
    router_logits, _, scoring, renormalize, _, _, _, routed_scaling_factor = inputs
    ctx.options = (scoring, renormalize, routed_scaling_factor)
    ctx.save_for_backward(router_logits, output[1])


def _router_backward(ctx, grad_weights: torch.Tensor, grad_ids: torch.Tensor | None) -> tuple:
    check_first_order()
    router_logits, topk_ids = ctx.saved_tensors
    scoring, renormalize, scaling = ctx.options
    grad = torch.ops.tmoe.topk_route_grad(grad_weights.contiguous(), router_logits, topk_ids, scoring, renormalize,
                                          scaling)
    return grad, None, None, None, None, None, None, None


def register_router_autograd(op: CustomOpDef) -> None:
    """The router's backward: router_logits' gradient from the weights' (the ids and the
    correction bias take none)."""
    op.register_autograd(_router_backward, setup_context=_router_setup)
