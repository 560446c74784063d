"""The arguments of one MoE layer call, written once: the layer op's schema, the face's keyword
arguments and the eager body all read this NamedTuple."""
from __future__ import annotations

from typing import NamedTuple

import torch


class LayerArgs(NamedTuple):
    """One layer call, in the layer op's argument order.

    hidden_states (M, K); w1 (E, 2N, K) gate rows then up rows; w2 (E, K, N); topk_weights
    (M, topk) float32; topk_ids (M, topk) int32/int64. ``activation``: silu, gelu, gelu_tanh,
    swigluoai. ``global_num_experts`` (-1: E) with ``expert_map`` (E_global,) int32, global id to
    local id or -1. fp8: ``w1_scale``/``w2_scale`` weight scales, ``a1_scale``/``a2_scale``
    static per-tensor activation scales (None: dynamic). ``apply_router_weight_on_input`` scales
    the input (topk == 1). ``w1_bias`` (E, 2N) / ``w2_bias`` (E, K): expert biases. Weight-only
    low-bit (``FusedMoEQuantConfig(weight_dtype=...)``): w1/w2 uint8 in vLLM's packed layouts,
    ``w1_scale``/``w2_scale`` group scales, ``w1_zp``/``w2_zp`` optional zero points (int4/int8).
    """

    hidden_states: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    activation: str = "silu"
    global_num_experts: int = -1
    expert_map: torch.Tensor | None = None
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    a1_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None
    apply_router_weight_on_input: bool = False
    w1_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    w1_zp: torch.Tensor | None = None
    w2_zp: torch.Tensor | None = None


_SCHEMA_TYPES = {"torch.Tensor": "Tensor", "torch.Tensor | None": "Tensor?", "str": "str", "int": "int",
                 "bool": "bool"}


def layer_schema(mutable_first: bool = False) -> str:
    """``LayerArgs`` as torch.library schema arguments (no parentheses); ``mutable_first`` marks
    hidden_states as written in place."""
    parts = []
    for i, (name, ann) in enumerate(LayerArgs.__annotations__.items()):
        typ = _SCHEMA_TYPES[getattr(ann, "__forward_arg__", ann)]  # a string, or a ForwardRef to one
        parts.append(f"{'Tensor(a!)' if i == 0 and mutable_first else typ} {name}")
    return ", ".join(parts)
