"""``"tmoe"`` in transformers' FP8 experts registry (``ALL_FP8_EXPERTS_FUNCTIONS``): fine-grained
fp8 checkpoints (DeepSeek-V3, Qwen3-FP8, ... loaded with ``FineGrainedFP8Config``) run tmoe's
block-fp8 layer.

transformers' ``FP8Experts`` keeps ``gate_up_proj`` (E, 2I, H) (gate rows, then up; ``up_proj``
(E, I, H) when not gated) and ``down_proj`` (E, H, I) in float8_e4m3fn with ``*_scale_inv``
block scales (E, cdiv(rows, bn), cdiv(cols, bk)) (w = q * scale_inv), and quantizes activations
dynamically in groups of 1 x bk: tmoe's ``FusedMoEQuantConfig(float8_e4m3fn, block_shape=(bn, bk))``
takes these tensors as stored, forward and backward (the weights frozen: the input and router
gradients, QLoRA-style). A module this does not fit (static activation scales, fp4 weights, a
softcapped gate, a gate clamped before its activation, scales of another shape) runs its class's
own forward, with a warning naming why, once per class and reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface

from tmoe.fused import fused_experts
from tmoe.integrations.hf_layout import ExpertsLayout, eager_forward, gating, no_mul_layout
from tmoe.integrations.hf_registry import NAME, module_layout
from tmoe.kernels.sizes import cdiv
from tmoe.modular.quant_config import FusedMoEQuantConfig

_FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8Layout:
    """One fp8 experts module's call into tmoe: its activation and its weights' block shape."""

    activation: ExpertsLayout
    block_shape: tuple[int, int]

    def quant_config(self) -> FusedMoEQuantConfig:
        return FusedMoEQuantConfig(_FP8, block_shape=self.block_shape)


def _gate(experts: nn.Module) -> ExpertsLayout | str:
    """The activation of ``FP8Experts._apply_gate`` (or of ``act_fn`` when not gated), through the
    registry's own gating decisions (``hf_layout.gating``)."""
    act_fn = getattr(experts, "act_fn", None)
    if not experts.has_gate:
        return no_mul_layout(act_fn)
    if getattr(experts, "gate_softcap", None) is not None:
        return "its gate is softcapped (mlp_gate_softcap), which tmoe's epilogue does not compute"
    if getattr(experts, "swiglu_alpha", None) is not None:  # GPT-OSS's clamped SwiGLU
        return gating(experts, ("swiglu_alpha", "limit"), act_fn)
    if getattr(experts, "limit", None) is not None and not getattr(experts, "limit_after_act", False):
        return "it clamps the gate before its activation (limit without limit_after_act); tmoe clamps after"
    return gating(experts, "clamped", act_fn)  # min(act(gate), limit) * clamp(up, ±limit), or unclamped


def fp8_layout(experts: nn.Module) -> Fp8Layout | str:
    """The module's call into tmoe's block-fp8 layer; a string says why tmoe cannot run it."""
    if getattr(experts, "activation_scheme", "dynamic") != "dynamic":
        return f"its activation scales are {experts.activation_scheme!r}; tmoe's block fp8 quantizes dynamically"
    block = getattr(experts, "block_size", None)
    if not (isinstance(block, (tuple, list)) and len(block) == 2 and all(isinstance(b, int) for b in block)):
        return f"its scales are not per block (block_size={block!r})"
    up = "gate_up_proj" if experts.has_gate else "up_proj"
    for proj in (up, "down_proj"):
        w, s = getattr(experts, proj, None), getattr(experts, f"{proj}_scale_inv", None)
        if not (isinstance(w, torch.Tensor) and w.dtype == _FP8 and w.dim() == 3):
            return f"{proj} is not a 3-D float8_e4m3fn tensor (fp4-packed or dequantized experts)"
        want = (w.shape[0], cdiv(w.shape[1], block[0]), cdiv(w.shape[2], block[1]))
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != want:
            return f"{proj}_scale_inv has shape {None if s is None else tuple(s.shape)}, not {want}"
    if block[1] < 16 or block[1] & (block[1] - 1):
        return f"block_size[1]={block[1]} (the activation group) is not a power of two >= 16"
    gate = _gate(experts)
    return gate if isinstance(gate, str) else Fp8Layout(gate, (block[0], block[1]))


def fp8_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t]) on the
    module's fp8 weights and block scales; ids outside [0, E) (expert-parallel sentinels) add 0.

    Args:
        hidden_states: (T, H) (or (..., H)) bf16/fp16/fp32; top_k_index, top_k_weights: (T, k).

    Returns:
        hidden_states' shape and dtype.
    """
    layout = module_layout(self, fp8_layout, "_tmoe_fp8_layout")
    if isinstance(layout, str):
        return eager_forward(type(self))(self, hidden_states, top_k_index, top_k_weights)
    up = "gate_up_proj" if self.has_gate else "up_proj"
    # frozen: fp8 weights take no gradient; x, the router weights (and LoRA around them) do
    w1, w2 = getattr(self, up).detach(), self.down_proj.detach()
    s1, s2 = (getattr(self, f"{p}_scale_inv").detach().float() for p in (up, "down_proj"))  # ue8m0 -> float32
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    out = fused_experts(x, w1, w2, top_k_weights.reshape(x.shape[0], -1).float().contiguous(),
                        top_k_index.reshape(x.shape[0], -1).contiguous(), quant_config=layout.quant_config(),
                        w1_scale=s1, w2_scale=s2, **layout.activation.options())
    return out.to(hidden_states.dtype).view(hidden_states.shape)


def register() -> None:
    """Add ``"tmoe"`` to transformers' FP8 experts registry (``ALL_FP8_EXPERTS_FUNCTIONS``)."""
    FP8ExpertsInterface.register(NAME, fp8_experts_forward)
