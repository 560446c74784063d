"""Swap the experts of Hugging Face ``transformers`` MoE models for tmoe's kernel, in place.

transformers (5.x) stores each sparse block's experts as 3-D tensors in tmoe's layout:
``gate_up_proj`` (E, 2I, H) gate rows first and ``down_proj`` (E, H, I). The swap keeps the
model's own router (so routing is bit-identical) and the same Parameters (no copy), and
replaces only the expert computation with ``FusedMoEModularKernel``.
"""
from __future__ import annotations

import torch
from torch import nn

from tmoe.experts import TritonExperts
from tmoe.modular_kernel import FusedMoEModularKernel
from tmoe.prepare_finalize import NoEPPrepareAndFinalize

SUPPORTED_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "DeepseekV3Experts")
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh"}


class TmoeExperts(nn.Module):
    """forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H), the
    call signature of transformers' ``*Experts`` modules."""

    def __init__(self, experts: nn.Module, activation: str) -> None:
        super().__init__()
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.num_experts = experts.num_experts
        self.activation = activation
        self.kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.kernel(hidden_states.contiguous(), self.gate_up_proj, self.down_proj,
                           top_k_weights.float().contiguous(), top_k_index.contiguous(), activation=self.activation)


def replace_moe_blocks(model: nn.Module) -> int:
    """Replace every supported experts module of ``model`` in place; returns how many.

    Raises ValueError for an activation tmoe does not implement. GPT-OSS (expert biases,
    interleaved gate/up) is not supported yet and is left unchanged.
    """
    act_name = getattr(getattr(model, "config", None), "hidden_act", "silu")
    if act_name not in HF_ACTIVATIONS:
        raise ValueError(f"hidden_act {act_name!r} is not supported by tmoe (have {sorted(HF_ACTIVATIONS)})")
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in SUPPORTED_EXPERTS]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, TmoeExperts(module, HF_ACTIVATIONS[act_name]))
    return len(targets)
