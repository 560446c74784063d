"""Operand checks of the backward ops (``tmoe.ops.backward``), run in each op and its fake before
any launch: every argument against the others (rows per token or per aligned row, widths against
the weights), naming the one that disagrees."""
from __future__ import annotations

import torch

from tmoe.kernels.activation import Activation
from tmoe.kernels.checks import (
    FLOAT_DTYPES, INDEX_DTYPES, check_align_outputs, check_last_dim_contiguous, check_router_weights, check_shape,
    check_tensor,
)


def check_first_order() -> None:
    """A backward run with grad mode on is a double backward (``create_graph=True``: gradient
    penalties, Hessian-vector products); tmoe's backward ops have no backward of their own."""
    if torch.is_grad_enabled():
        raise NotImplementedError("tmoe's MoE backward is not differentiable: create_graph=True (double backward, "
                                  "e.g. a gradient penalty or a Hessian-vector product) is not supported; "
                                  "differentiate once, or use the float32 reference tmoe.reference.moe_reference "
                                  "for higher-order gradients")


def check_grad_act(
    grad_out: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post_padded: torch.Tensor,
    w1_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, activation: Activation, codes_per_byte: int = 1,
) -> None:
    """``moe_grad_act``'s operands against each other: grad_out like x (M, K); w2 (E, K, N) and w1
    (E, 2N, K) (N rows for a *_no_mul activation); router weights (M, topk); biases (E, 2N) and
    (E, K); the align's int32 outputs; all on x's device (weight dtypes: ``BlockScales.of``).
    ``codes_per_byte`` 2: 4-bit weights, their last dimension packed (N / 2, K / 2)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    dev = x.device
    check_tensor("grad_out", grad_out, dtypes=(x.dtype,), device=dev)
    check_shape("grad_out", grad_out, tuple(x.shape))
    check_tensor("w1", w1, ndim=3, device=dev)
    check_tensor("w2", w2, ndim=3, device=dev)
    e, n, k = w2.shape[0], w2.shape[2] * codes_per_byte, x.shape[1]
    check_shape("w2", w2, (e, k, w2.shape[2]))
    check_shape("w1", w1, (e, activation.rows_per_n * n, k // codes_per_byte))
    check_router_weights(topk_weights, x.shape[0], dev)
    check_align_outputs(sorted_ids, expert_ids, num_post_padded, dev)
    for name, bias, cols in (("w1_bias", w1_bias, w1.shape[1]), ("w2_bias", w2_bias, k)):
        if bias is not None:
            check_tensor(name, bias, device=dev)
            check_shape(name, bias, (e, cols))


def check_preact(preact: torch.Tensor | None, x: torch.Tensor, w1: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """A saved pre-activation is (num_slots, W1's rows) in x's dtype with contiguous rows, on x's device."""
    if preact is None:
        return
    check_tensor("preact", preact, dtypes=(x.dtype,), ndim=2, device=x.device)
    check_shape("preact", preact, (topk_weights.numel(), w1.shape[1]))
    check_last_dim_contiguous("preact", preact)


def check_grad_input(
    grad_h: torch.Tensor, w1: torch.Tensor, partial: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post_padded: torch.Tensor,
) -> None:
    """``moe_grad_input``'s operands as ``moe_grad_act`` and the align leave them: grad_h (P, rows of
    w1) and partial (P, parts) float32 with unit column stride, P = len(sorted_ids); the routing
    (M, topk); the align's int32 outputs; all on grad_h's device."""
    check_tensor("grad_h", grad_h, dtypes=FLOAT_DTYPES, ndim=2)
    dev = grad_h.device
    check_tensor("w1", w1, ndim=3, device=dev)
    rows = check_align_outputs(sorted_ids, expert_ids, num_post_padded, dev)
    if tuple(grad_h.shape) != (rows, w1.shape[1]):
        raise ValueError(f"grad_h must have shape (P={rows} = len(sorted_token_ids), rows of w1={w1.shape[1]}), "
                         f"got {tuple(grad_h.shape)}")
    check_last_dim_contiguous("grad_h", grad_h)
    check_tensor("partial", partial, dtypes=(torch.float32,), ndim=2, device=dev)
    if partial.shape[0] != rows:
        raise ValueError(f"partial must have P={rows} rows (one per aligned row), got shape {tuple(partial.shape)}")
    check_last_dim_contiguous("partial", partial)
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, ndim=2, device=dev)
    check_router_weights(topk_weights, topk_ids.shape[0], dev)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))


def check_grad_weight(
    left: torch.Tensor, right: torch.Tensor | None, topk_weights: torch.Tensor, sorted_ids: torch.Tensor,
    expert_offsets: torch.Tensor, tokens_left: bool, expert_map: torch.Tensor | None,
) -> None:
    """``moe_grad_weight``'s (``right`` None: ``moe_grad_bias``'s) operands against each other: the
    token operand (M rows, M = topk_weights' rows) and the aligned one (P = len(sorted_token_ids)
    rows), float, one dtype; the align's int32 ``sorted_token_ids`` and ``expert_offsets`` (E + 1);
    an int32 expert map of E entries; all on left's device."""
    check_tensor("left", left, dtypes=FLOAT_DTYPES, ndim=2)
    dev = left.device
    check_tensor("sorted_token_ids", sorted_ids, dtypes=(torch.int32,), ndim=1, device=dev)
    check_tensor("expert_offsets", expert_offsets, dtypes=(torch.int32,), ndim=1, device=dev)
    check_router_weights(topk_weights, None, dev)  # its rows define the tokens
    rows = {"left": sorted_ids.shape[0], "right": topk_weights.shape[0]}
    if tokens_left:
        rows = {"left": topk_weights.shape[0], "right": sorted_ids.shape[0]}
    operands = {"left": left} if right is None else {"left": left, "right": right}
    for name, t in operands.items():
        check_tensor(name, t, dtypes=(left.dtype,), ndim=2, device=dev)
        what = "tokens (topk_weights' rows)" if (name == "left") == tokens_left else "aligned rows (len(sorted_token_ids))"
        if t.shape[0] != rows[name]:
            raise ValueError(f"{name} must have {rows[name]} rows, one per {what}, got shape {tuple(t.shape)}")
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, device=dev)
        if expert_map.shape[0] != expert_offsets.shape[0] - 1:
            raise ValueError(f"expert_map must have E = len(expert_offsets) - 1 = {expert_offsets.shape[0] - 1} "
                             f"entries, got {expert_map.shape[0]}")
