"""``tmoe.FusedMoE``: an nn.Module holding a router and expert weights in tmoe's layout,
whose forward is router -> modular kernel."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tmoe.experts import TritonExperts
from tmoe.modular_kernel import FusedMoEModularKernel
from tmoe.prepare_finalize import NoEPPrepareAndFinalize


@dataclass(frozen=True)
class RouterConfig:
    """How router logits become (weights, ids): see ``tmoe.topk_route``."""

    topk: int
    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_group: int = 0
    topk_group: int = 0
    routed_scaling_factor: float = 1.0


class FusedMoE(nn.Module):
    """An MoE block: out = sum_t w_t * expert_{e_t}(x) with (w, e) = topk_route(x @ router.T).

    Weights: ``router_weight`` (E, hidden) (None when the caller passes ``router_logits``),
    ``w1`` (E, 2 * intermediate, hidden) gate rows then up rows, ``w2`` (E, hidden, intermediate),
    optional ``e_score_correction_bias`` (E,) float32 for sigmoid scoring.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, topk: int, *,
                 activation: str = "silu", scoring: str = "softmax", renormalize: bool = True,
                 num_expert_group: int = 0, topk_group: int = 0, routed_scaling_factor: float = 1.0,
                 score_correction_bias: bool = False, router: bool = True, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, kernel: FusedMoEModularKernel | None = None) -> None:
        super().__init__()
        self.activation = activation
        self.routing = RouterConfig(topk, scoring, renormalize, num_expert_group, topk_group, routed_scaling_factor)
        e, k, n = num_experts, hidden_size, intermediate_size
        make = dict(dtype=dtype, device=device)
        self.router_weight = nn.Parameter(torch.randn(e, k, **make) / k**0.5, requires_grad=False) if router else None
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(e, device=device), requires_grad=False)
                                        if score_correction_bias else None)
        self.w1 = nn.Parameter(torch.randn(e, 2 * n, k, **make) / k**0.5, requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(e, k, n, **make) / n**0.5, requires_grad=False)
        self.kernel = kernel or FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts())

    @classmethod
    def from_experts(cls, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor], topk: int,
                     router_weight: torch.Tensor | None = None, **kwargs) -> "FusedMoE":
        """Build from per-expert linear weights: gate/up (intermediate, hidden), down (hidden, intermediate)."""
        n, k = gate[0].shape
        layer = cls(len(gate), k, n, topk, router=router_weight is not None, dtype=gate[0].dtype,
                    device=gate[0].device, **kwargs)
        with torch.no_grad():
            layer.w1.copy_(torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up)]))
            layer.w2.copy_(torch.stack(down))
            if router_weight is not None:
                layer.router_weight.copy_(router_weight)
        return layer

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        return torch.ops.tmoe.topk_route(router_logits, r.topk, r.scoring, r.renormalize, r.num_expert_group,
                                         r.topk_group, self.e_score_correction_bias, r.routed_scaling_factor)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states (..., hidden) -> (..., hidden); router_logits (tokens, E) if no router."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        if router_logits is None:
            if self.router_weight is None:
                raise ValueError("router_logits must be given to a FusedMoE built without a router")
            router_logits = F.linear(x, self.router_weight)
        weights, ids = self.route(router_logits)
        return self.kernel(x, self.w1, self.w2, weights, ids, activation=self.activation).view(hidden_states.shape)
