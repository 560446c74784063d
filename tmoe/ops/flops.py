"""FLOP formulas for ``torch.utils.flop_counter.FlopCounterMode`` (MFU): the layer ops, the GEMM
stage ops and the backward GEMM ops (the backward counts the pre-activation when it recomputes it).
``register_flops(op, formula)`` registers one for any tmoe op; the formula takes the op's
arguments by schema name, tensors as their shapes."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.flop_counter import register_flop_formula

from tmoe.kernels.activation import Activation

Formula = Callable[[dict], int]


def register_flops(op: torch._ops.OpOverloadPacket, formula: Formula) -> None:
    """Have FlopCounterMode count ``formula(args)`` for each call of ``op``; ``args`` maps every
    schema argument name to its value (a tensor as its shape; defaults filled in)."""
    schema = op.default._schema

    def count(*args, out_shape=None, **kwargs) -> int:
        bound = {a.name: a.default_value if a.has_default_value() else None for a in schema.arguments}
        bound.update(zip((a.name for a in schema.arguments), args))
        bound.update(kwargs)
        return formula(bound)

    register_flop_formula(op)(count)


def layer_flops(a: dict) -> int:
    """2·M·topk·(K·rows(w1) + N·K): rows(w1) = 2N gated, N for a *_no_mul activation (the count of
    the routed GEMMs, whatever the weights' storage; slots of remote experts included)."""
    m, k = a["hidden_states"]
    topk = a["topk_ids"][1]
    rows = a["w1"][1]
    n = Activation(a["activation"]).intermediate_size(rows)
    return 2 * m * topk * (k * rows + n * k)


def gemm_up_flops(a: dict) -> int:
    """2·M·topk·K·rows(w1), hidden_states (M, K), w1 (E, rows, K)."""
    m, k = a["hidden_states"]
    return 2 * m * a["topk"] * k * a["w1"][1]


def gemm_down_flops(a: dict) -> int:
    """2·slots·N·K, intermediate (slots, N), w2 (E, K, N)."""
    slots, n = a["intermediate"]
    return 2 * slots * n * a["w2"][1]


def grad_act_flops(a: dict) -> int:
    """2·slots·K·(N + rows(w1)): the intermediate's gradient (grad_out @ w2) and the recomputed
    pre-activation (x @ w1.T), 2·slots·K·N when the forward saved it (``preact``); slots =
    topk_weights' elements."""
    slots = a["topk_weights"][0] * a["topk_weights"][1]
    return 2 * slots * a["grad_out"][1] * (a["w2"][2] + (0 if a["preact"] is not None else a["w1"][1]))


def grad_input_flops(a: dict) -> int:
    """2·slots·rows(w1)·K: dh @ w1 per slot."""
    slots = a["topk_ids"][0] * a["topk_ids"][1]
    return 2 * slots * a["w1"][1] * a["w1"][2]


def grad_weight_flops(a: dict) -> int:
    """2·slots·P·Q: the K-grouped GEMM of left (·, P) and right (·, Q) over the routed slots."""
    slots = a["topk_weights"][0] * a["topk_weights"][1]
    return 2 * slots * a["left"][1] * a["right"][1]


def register_all() -> None:
    ops = torch.ops.tmoe
    for op, formula in ((ops.modular_forward, layer_flops), (ops.modular_forward_, layer_flops),
                        (ops.modular_forward_train, layer_flops),
                        (ops.moe_gemm_up, gemm_up_flops), (ops.moe_gemm_down, gemm_down_flops),
                        (ops.moe_grad_act, grad_act_flops), (ops.moe_grad_input, grad_input_flops),
                        (ops.moe_grad_weight, grad_weight_flops)):
        register_flops(op, formula)
