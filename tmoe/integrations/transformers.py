"""Swap the experts of Hugging Face ``transformers`` MoE models for tmoe's kernel, in place.

transformers (5.x) stores each sparse block's experts as 3-D tensors. Mixtral, Qwen2-MoE,
Qwen3-MoE and DeepSeek-V3 use tmoe's layout (``gate_up_proj`` (E, 2I, H) gate rows first,
``down_proj`` (E, H, I)) and keep their Parameters (no copy). GPT-OSS stores them transposed
with gate/up interleaved and has expert biases: its weights are re-laid once at swap time and
run with the ``swigluoai`` activation. The swap keeps each model's own router, so routing is
unchanged, and replaces only the expert computation with ``FusedMoEModularKernel``.
"""
from __future__ import annotations

import torch
from torch import nn

from tmoe.layer import FusedMoEModularKernel
from tmoe.modular import NoEPPrepareAndFinalize, TritonExperts

SUPPORTED_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "DeepseekV3Experts", "GptOssExperts")
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh"}


class TmoeExperts(nn.Module):
    """forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H), the
    call signature of transformers' ``*Experts`` modules."""

    def __init__(self, experts: nn.Module, activation: str) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.activation = activation
        self.gate_up_proj_bias = self.down_proj_bias = None
        if type(experts).__name__ == "GptOssExperts":
            if (experts.alpha, experts.limit) != (1.702, 7.0):
                raise ValueError(f"swigluoai is built for alpha=1.702, limit=7.0; got {experts.alpha}, {experts.limit}")
            self.activation = "swigluoai"
            w = experts.gate_up_proj.detach().transpose(1, 2)  # (E, 2I, H), rows gate0, up0, gate1, ...
            b = experts.gate_up_proj_bias.detach()
            self.gate_up_proj = nn.Parameter(torch.cat([w[:, 0::2], w[:, 1::2]], 1).contiguous(), requires_grad=False)
            self.gate_up_proj_bias = nn.Parameter(torch.cat([b[:, 0::2], b[:, 1::2]], 1).contiguous(),
                                                  requires_grad=False)
            self.down_proj = nn.Parameter(experts.down_proj.detach().transpose(1, 2).contiguous(), requires_grad=False)
            self.down_proj_bias = experts.down_proj_bias
        else:
            self.gate_up_proj = experts.gate_up_proj
            self.down_proj = experts.down_proj
        self.kernel = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.kernel(hidden_states.contiguous(), self.gate_up_proj, self.down_proj,
                           top_k_weights.float().contiguous(), top_k_index.contiguous(), activation=self.activation,
                           w1_bias=self.gate_up_proj_bias, w2_bias=self.down_proj_bias)


def replace_moe_blocks(model: nn.Module) -> int:
    """Replace every supported experts module of ``model`` in place; returns how many.

    Raises ValueError for an activation tmoe does not implement (GPT-OSS experts always use
    ``swigluoai``, whatever ``hidden_act`` says).
    """
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in SUPPORTED_EXPERTS]
    act_name = getattr(getattr(model, "config", None), "hidden_act", "silu")
    standard = [m for _, m in targets if type(m).__name__ != "GptOssExperts"]
    if standard and act_name not in HF_ACTIVATIONS:
        raise ValueError(f"hidden_act {act_name!r} is not supported by tmoe (have {sorted(HF_ACTIVATIONS)})")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, TmoeExperts(module, HF_ACTIVATIONS.get(act_name, "silu")))
    return len(targets)
