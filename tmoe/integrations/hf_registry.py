"""``"tmoe"`` in transformers' experts registry: ``experts_implementation="tmoe"``.

``experts_forward`` serves every experts class that carries ``@use_experts_implementation``: it
reads the class's flags, gating and weights as stored (``tmoe.integrations.hf_layout``) and calls
``tmoe.fused_experts``, so autograd reaches the module's own Parameters; PEFT's
``target_parameters`` LoRA on them runs fused (``tmoe.integrations.hf_peft``). A module tmoe cannot run
(a post-expert norm, an activation or gating tmoe lacks) runs its class's own forward, with a
warning naming why, once per class and reason. ``set_batch_invariant(model, True)`` runs a model's
experts in tmoe's batch-invariant mode (``tmoe.batch_invariant()`` does it for every call in a block).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from tmoe.fused import fused_experts
from tmoe.integrations.hf_layout import ExpertsLayout, eager_forward, layout_of
from tmoe.integrations.hf_peft import peft_adapters

NAME = "tmoe"
BATCH_INVARIANT = "tmoe_batch_invariant"  # the experts module's attribute set_batch_invariant writes
_WARNED: set[tuple[str, str]] = set()


def warn_once(cls: type, why: str) -> None:
    if (cls.__name__, why) not in _WARNED:
        _WARNED.add((cls.__name__, why))
        warnings.warn(f'experts_implementation="{NAME}": {cls.__name__} runs its own (eager) forward: {why}',
                      stacklevel=3)


def module_layout(experts: nn.Module, decide: Callable[[nn.Module], object] = layout_of,
                  key: str = "_tmoe_layout") -> object:
    """The module's layout by ``decide`` (a string: why tmoe cannot run it), decided at its first
    eager call and kept on it under ``key`` (under torch.compile the decision is made while
    tracing and costs nothing per call); a refusal warns once per class and reason."""
    layout = experts.__dict__.get(key)
    if layout is None:
        layout = decide(experts)
        if not torch.compiler.is_compiling():
            experts.__dict__[key] = layout
            if isinstance(layout, str):
                warn_once(type(experts), layout)
    return layout


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t]); ids outside
    [0, E) (expert-parallel sentinels) add exactly 0.

    Args:
        hidden_states: (T, H) (or (..., H)); top_k_index, top_k_weights: (T, k).

    Returns:
        hidden_states' shape and dtype.
    """
    layout = module_layout(self)
    if isinstance(layout, str):
        return eager_forward(type(self))(self, hidden_states, top_k_index, top_k_weights)
    stored, adapters = peft_adapters(self, layout.up_name, layout.transposed)  # PEFT's LoRA, run fused
    w1, w2, b1, b2 = layout.weights(self, stored)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    out = fused_experts(x.to(w1.dtype), w1, w2, top_k_weights.reshape(x.shape[0], -1).float().contiguous(),
                        top_k_index.reshape(x.shape[0], -1).contiguous(), w1_bias=b1, w2_bias=b2,
                        batch_invariant=getattr(self, BATCH_INVARIANT, None), **layout.options(), **adapters)
    return out.to(hidden_states.dtype).view(hidden_states.shape)


def register() -> None:
    """Add ``"tmoe"`` to transformers' experts registry (``ALL_EXPERTS_FUNCTIONS``)."""
    ExpertsInterface.register(NAME, experts_forward)
