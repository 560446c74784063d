"""The arguments of one MoE layer call, written once: the layer op's schema, the face's keyword
arguments and the eager body all read this NamedTuple."""
from __future__ import annotations

from typing import NamedTuple

import torch

from tmoe.kernels.activation import Activation

RuntimeFloat = float
"""A float the layer op takes as a ``Scalar`` schema argument and the kernels as a plain (never
specialised) float argument: a new value compiles no new kernel. Under torch.compile, dynamo keeps
it symbolic with backend="eager"; an AOT backend (inductor, aot_eager) specialises a float that
reaches a custom op, so there a new value retraces the graph once (guard ``value == v``), as a
``float`` schema argument would under every backend."""


class LayerArgs(NamedTuple):
    """One layer call, in the layer op's argument order.

    hidden_states (M, K); w1 (E, 2N, K) gate rows then up rows (E, N, K for a *_no_mul
    activation); w2 (E, K, N); topk_weights (M, topk) float32; topk_ids (M, topk) int32/int64.
    ``activation``: gated act(gate) * up: silu, gelu, gelu_tanh, swigluoai (GPT-OSS:
    clamp(gate, max=limit) * sigmoid(alpha * gate) * (clamp(up, -limit, limit) + 1)); non-gated
    act(h): silu_no_mul, gelu_no_mul, relu2_no_mul (relu(h)^2). ``global_num_experts`` (-1: E)
    with ``expert_map`` (E_global,) int32, global id to local id or -1. fp8:
    ``w1_scale``/``w2_scale`` weight scales, ``a1_scale``/``a2_scale`` static per-tensor
    activation scales (None: dynamic). ``apply_router_weight_on_input`` scales the input
    (topk == 1). ``w1_bias`` (E, 2N) / ``w2_bias`` (E, K): expert biases, w1_bias in w1's row
    order. ``swiglu_alpha`` (swigluoai only; None: 1.702) and ``swiglu_limit`` (swigluoai, None:
    7.0; silu, None: no clamp, else the clamped silu min(silu(gate), limit) * clamp(up, -limit,
    limit)): runtime floats, a new value compiles no new kernel. ``gate_up_interleaved``: w1's
    rows (and w1_bias) alternate gate and up (row 2j gate j, row 2j + 1 up j; GPT-OSS's layout)
    instead of gate rows then up rows. Weight-only low-bit (``FusedMoEQuantConfig(weight_dtype=...)``):
    w1/w2 uint8 in vLLM's packed layouts, ``w1_scale``/``w2_scale`` group scales,
    ``w1_zp``/``w2_zp`` optional zero points (int4/int8). LoRA on the experts (float weights):
    ``w1_lora_a`` (E, r1, K) and ``w1_lora_b`` (E, 2N, r1) (w1's rows), ``w2_lora_a`` (E, r2, N)
    and ``w2_lora_b`` (E, K, r2), hidden_states' dtype, each pair optional, r <= 128; the experts
    run w + ``lora_scale`` * b @ a (None: 1.0) without forming it (``tmoe.kernels.lora``).
    Several adapters at once (serving, vLLM's MoE-LoRA contract): the factors stacked, (L, E, r1, K)
    / (L, E, 2N, r1) and (L, E, r2, N) / (L, E, K, r2), and ``lora_ids`` (M,) int32/int64 each
    token's adapter in [0, L), -1 (or any id outside [0, L)) for none; forward only.
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
    swiglu_alpha: RuntimeFloat | None = None
    swiglu_limit: RuntimeFloat | None = None
    gate_up_interleaved: bool = False
    w1_zp: torch.Tensor | None = None
    w2_zp: torch.Tensor | None = None
    w1_lora_a: torch.Tensor | None = None
    w1_lora_b: torch.Tensor | None = None
    w2_lora_a: torch.Tensor | None = None
    w2_lora_b: torch.Tensor | None = None
    lora_scale: RuntimeFloat | None = None
    lora_ids: torch.Tensor | None = None

    def activation_value(self) -> Activation:
        """``activation`` and its options as the one value the experts and kernels carry."""
        return Activation.from_args(self.activation, self.swiglu_alpha, self.swiglu_limit, self.gate_up_interleaved)


_SCHEMA_TYPES = {"torch.Tensor": "Tensor", "torch.Tensor | None": "Tensor?", "str": "str", "int": "int",
                 "bool": "bool", "float": "float", "float | None": "float?",
                 "RuntimeFloat | None": "Scalar?"}


def layer_schema(mutable_first: bool = False) -> str:
    """``LayerArgs`` as torch.library schema arguments (no parentheses); ``mutable_first`` marks
    hidden_states as written in place."""
    parts = []
    for i, (name, ann) in enumerate(LayerArgs.__annotations__.items()):
        typ = _SCHEMA_TYPES[getattr(ann, "__forward_arg__", ann)]  # a string, or a ForwardRef to one
        parts.append(f"{'Tensor(a!)' if i == 0 and mutable_first else typ} {name}")
    return ", ".join(parts)
