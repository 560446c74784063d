"""``MoEProblem``: what a layer call is apart from its token count, decided once by the checks
(``tmoe.modular.checks.check_layer_call``) and carried by the call plan, the experts' calls and
the backward, so nothing below re-derives the intermediate size, the expert counts or the activation."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tmoe.kernels.activation import Activation


def global_expert_count(global_num_experts: int, num_local_experts: int) -> int:
    """The experts topk_ids index: ``global_num_experts`` (expert parallelism), or -1 (any value
    below 1): the local ones."""
    return global_num_experts if global_num_experts > 0 else num_local_experts


@dataclass(frozen=True)
class MoEProblem:
    """M-independent sizes and choices of a layer call.

    ``num_experts``: the global expert count (topk_ids' range); ``num_local_experts``: w1's E;
    ``n``: the intermediate size; ``k``: the hidden size; ``topk``; ``activation`` (its rows per
    intermediate column tell W1's rows); ``dtype``: hidden_states'; ``weight_dtype``: w1/w2 as stored
    (float, fp8 or uint8 low-bit codes); ``batch_invariant``: the call runs in the batch-invariant
    mode (decided once per call by the layer op: ``tmoe.config.invariant``). Built by
    ``check_layer_call`` (N derived there once, from w1's rows and the activation)."""

    num_experts: int
    num_local_experts: int
    n: int
    k: int
    topk: int
    activation: Activation
    dtype: torch.dtype
    weight_dtype: torch.dtype
    batch_invariant: bool = False
    lora_ranks: tuple[int, int] = (0, 0)
    lora_adapters: int = 0

    @property
    def lora(self) -> bool:
        """The call carries a LoRA adapter on w1 or w2 (``lora_ranks``: their ranks, 0 for none;
        ``lora_adapters``: with ``lora_ids``, the stacked adapters' count L, else 0)."""
        return any(self.lora_ranks)

    @property
    def w1_rows(self) -> int:
        """W1's rows: 2N for act(gate) * up, N for a *_no_mul activation."""
        return self.activation.rows_per_n * self.n
