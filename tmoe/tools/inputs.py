"""What a benchmark runs on: the layer shapes, one rotation set of routed inputs, random weights,
and a provider (a named call of one set)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class RoutedInputs:
    """One rotation set: x (M, K) bf16, topk_weights (M, topk) float32, topk_ids (M, topk) int32."""

    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


@dataclass(frozen=True)
class Provider:
    """``fn(inputs) -> (M, K)``; ``syncs``: the call waits on the host, so it cannot be graph-captured."""

    name: str
    fn: Callable[[RoutedInputs], torch.Tensor]
    syncs: bool = False


def make_weights(e: int, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 w1 (e, 2n, k) and w2 (e, k, n), std 1/sqrt(fan-in), filled in place (no temporaries)."""
    w1 = torch.empty(e, 2 * n, k, dtype=torch.bfloat16, device=device).normal_(0.0, k ** -0.5)
    w2 = torch.empty(e, k, n, dtype=torch.bfloat16, device=device).normal_(0.0, n ** -0.5)
    return w1, w2


def make_inputs(m: int, e: int, k: int, topk: int, n_sets: int, device: torch.device) -> list[RoutedInputs]:
    """``n_sets`` independent inputs with random softmax top-k routing."""
    sets = []
    for _ in range(n_sets):
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        weights, ids = torch.topk(torch.randn(m, e, device=device).softmax(-1), topk)
        sets.append(RoutedInputs(x, weights.contiguous(), ids.to(torch.int32).contiguous()))
    return sets


@dataclass(frozen=True)
class Shape:
    """One MoE layer: w1 (e, 2n, k), w2 (e, k, n), topk experts per token, M up to max_m."""

    name: str
    e: int
    n: int
    k: int
    topk: int
    max_m: int = 1 << 30


SHAPES = {
    "mixtral": Shape("mixtral", 8, 14336, 4096, 2),
    "qwen3": Shape("qwen3", 128, 768, 2048, 8),
    "deepseek": Shape("deepseek", 256, 2048, 7168, 8, max_m=4096),
}
