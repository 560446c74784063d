"""How a transformers experts module maps onto tmoe's layer call.

tmoe takes ``w1`` (E, 2N, K) (gate rows then up rows, or alternating with ``gate_up_interleaved``;
(E, N, K) for a non-gated activation) and ``w2`` (E, K, N). A transformers experts module stores
``gate_up_proj`` (or ``up_proj`` when not gated) and ``down_proj`` as (E, out, in), or as (E, in,
out) when transposed; tmoe reads the transposed ones through strides (a view, never a copy, so a
training step's update is what the next call reads). The gating is read from the class's
``_apply_gate`` (transformers' default ``act_fn(gate) * up``, or one of the overrides tmoe knows)
and the module's ``act_fn``; ``ExpertsLayout`` carries the decision.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations import moe as hf_moe

from tmoe.kernels.activation import Activation

# Hugging Face activation names whose module computes one of tmoe's gate activations.
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_python": "gelu",
                   "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                   "gelu_fast": "gelu_tanh", "gelu_accurate": "gelu_tanh"}
_ACTIVATION_TYPES = {type(ACT2FN[name]): act for name, act in _HF_ACTIVATIONS.items() if name in ACT2FN}
# act(h) of non-gated experts (``has_gate=False``): tmoe's *_no_mul activations.
_NO_MUL = {"silu": "silu_no_mul", "gelu": "gelu_no_mul"}
_RELU2 = type(ACT2FN["relu2"]) if "relu2" in ACT2FN else None

# ``_apply_gate`` by the class that defines it (transformers' default: "_default_apply_gate"), and what tmoe runs for each. "act": act_fn(gate) * up
# (Beam's computes it in float32, as tmoe's epilogue does); "clamped": min(act_fn(gate), limit) *
# clamp(up, ±limit) with the module's ``limit`` (None: unclamped); a pair: swigluoai with the module's
# (alpha, limit) attributes. Any other override makes the module run its own forward.
GATES: dict[str, str | tuple[str, str]] = {
    "_default_apply_gate": "act",
    "BeamExperts._apply_gate": "act",
    "BailingHybridExperts._apply_gate": "clamped",
    "Step3p7Experts._apply_gate": "clamped",
    "GptOssExperts._apply_gate": ("alpha", "limit"),
    "OpenAIPrivacyFilterExperts._apply_gate": ("alpha", "limit"),
    "MiniMaxM3VLExperts._apply_gate": ("swiglu_alpha", "swiglu_limit"),
}


@dataclass(frozen=True)
class ExpertsLayout:
    """One experts module's call into tmoe: its ``activation`` (tmoe's value: swigluoai's alpha,
    the clamp limit, gate/up rows interleaved; gated ones read ``gate_up_proj``, *_no_mul ones
    ``up_proj``), and how its weights are stored: ``transposed`` (E, in, out), with ``bias``."""

    activation: Activation
    transposed: bool = False
    bias: bool = False

    @property
    def up_name(self) -> str:
        """The attribute holding W1: ``gate_up_proj``, or ``up_proj`` for a *_no_mul activation."""
        return "gate_up_proj" if self.activation.mul else "up_proj"

    def weights(self, experts: nn.Module, stored: dict[str, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(w1, w2, w1_bias, w2_bias) in tmoe's layout: the stored tensors, transposed ones as views;
        ``stored``: tensors to read instead of the module's attributes (PEFT's unadapted weights)."""
        up, stored = self.up_name, stored or {}
        w1 = stored[up] if up in stored else getattr(experts, up)
        w2 = stored["down_proj"] if "down_proj" in stored else experts.down_proj
        if self.transposed:
            w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
        if not self.bias:
            return w1, w2, None, None
        return w1, w2, getattr(experts, f"{up}_bias"), experts.down_proj_bias

    def stored(self, transposed: bool, bias: bool, interleaved: bool) -> ExpertsLayout:
        """This layout for weights stored ``transposed``, with ``bias``, gate/up rows ``interleaved``."""
        return replace(self, activation=replace(self.activation, interleaved=interleaved), transposed=transposed,
                       bias=bias)

    def options(self) -> dict[str, object]:
        """The activation keyword arguments of ``tmoe.fused_experts``."""
        return self.activation.layer_kwargs()


def finite_number(v: object) -> bool:
    """Whether ``v`` is a finite int or float (comparisons, not ``math.isfinite``: under
    ``torch.compile(dynamic=True)`` a module's float attribute is symbolic, and dynamo traces
    comparisons on it but not ``math.isfinite``)."""
    return isinstance(v, (int, float)) and -math.inf < v < math.inf


def tmoe_activation(act_fn: object) -> str | None:
    """tmoe's gate activation for a transformers activation module (or ``F.silu``); None if tmoe lacks it."""
    return "silu" if act_fn is F.silu else _ACTIVATION_TYPES.get(type(act_fn))


def gate_limit(experts: nn.Module) -> float | None:
    """The clamp of Step3p7 / BailingHybrid: min(act(gate), limit) * clamp(up, ±limit); None: no clamp."""
    limit = getattr(experts, "limit", None)
    return float(limit) if finite_number(limit) else None


def gating(experts: nn.Module, gate: str | tuple[str, str], act_fn: object) -> ExpertsLayout | str:
    """The activation part of the layout for gate kind ``gate`` (see ``GATES``); a string says why
    tmoe cannot run it."""
    if isinstance(gate, tuple):
        alpha, limit = (getattr(experts, name, None) for name in gate)
        if not (finite_number(alpha) and finite_number(limit)) or limit <= 0:
            return f"swigluoai needs a finite alpha and a positive finite limit, got ({alpha}, {limit})"
        return ExpertsLayout(Activation("swigluoai", float(alpha), float(limit)))
    activation = tmoe_activation(act_fn)
    if activation is None:
        return f"activation {type(act_fn).__name__} is not one of tmoe's"
    limit = gate_limit(experts) if gate == "clamped" else None
    if limit is not None and (activation != "silu" or limit <= 0):
        return f"clamps the activated gate (limit={limit}) of a {activation} gate; tmoe clamps silu by a positive limit"
    return ExpertsLayout(Activation(activation, limit=limit))


def is_registry_class(cls: type) -> bool:
    """Whether ``cls`` dispatches its forward through transformers' experts registry
    (``@use_experts_implementation``, on it or a base class)."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and code.co_filename == hf_moe.__file__


def eager_forward(cls: type) -> Callable[..., torch.Tensor]:
    """The class's own experts forward, under the registry's dispatch (on ``cls`` or a base class)."""
    return next(vars(c)["forward"].__wrapped__ for c in cls.__mro__ if is_registry_class(c) and "forward" in vars(c))


@torch.compiler.assume_constant_result  # a class's gating is fixed: dynamo takes the answer, not the walk
def _gate_name(cls: type) -> str:
    """``<defining class>._apply_gate``, or ``_default_apply_gate`` for transformers' own (read off
    the class dictionaries: dynamo traces a function's ``__qualname__`` wrongly, and class
    dictionaries that transformers mutated not at all, so it runs this once, as a constant)."""
    owner = next(c for c in cls.__mro__ if "_apply_gate" in vars(c))
    default = vars(owner)["_apply_gate"] is hf_moe._default_apply_gate
    return "_default_apply_gate" if default else f"{owner.__name__}._apply_gate"


def no_mul_layout(act_fn: object) -> ExpertsLayout | str:
    """The layout of non-gated experts computing ``act_fn(h)`` (tmoe's *_no_mul activations); a
    string says why tmoe cannot run it."""
    activation = "relu2_no_mul" if _RELU2 is not None and isinstance(act_fn, _RELU2) else _NO_MUL.get(
        tmoe_activation(act_fn))
    return ExpertsLayout(Activation(activation)) if activation else f"activation {type(act_fn).__name__} is not one of tmoe's"


def layout_of(experts: nn.Module) -> ExpertsLayout | str:
    """The layout of a module whose class carries ``@use_experts_implementation``, from the flags
    the decorator records and the class's gating; a string says why tmoe cannot run it."""
    if getattr(experts, "has_post_expert_norm", False):
        return "it normalizes each expert's output (has_post_expert_norm), which tmoe's kernels do not"
    gated, transposed = experts.has_gate, experts.is_transposed
    up = "gate_up_proj" if gated else "up_proj"
    w1, w2 = getattr(experts, up, None), getattr(experts, "down_proj", None)
    if not (isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor) and w1.dim() == w2.dim() == 3):
        return f"needs 3-D {up} and down_proj tensors"
    if gated:
        name = _gate_name(type(experts))
        if name not in GATES:
            return f"its gating {name} is not one tmoe computes"
        layout = gating(experts, GATES[name], getattr(experts, "act_fn", None))
    else:
        layout = no_mul_layout(getattr(experts, "act_fn", None))
    if isinstance(layout, str):
        return layout
    return layout.stored(transposed, experts.has_bias, interleaved=gated and not experts.is_concatenated)
