"""``tmoe.fused_experts``: vLLM's fused-MoE call, run by the default modular kernel."""
from __future__ import annotations

import torch

from tmoe.experts import TritonExperts
from tmoe.modular import FusedMoEQuantConfig
from tmoe.modular_kernel import FusedMoEModularKernel
from tmoe.prepare_finalize import NoEPPrepareAndFinalize

_DEFAULT_KERNELS: dict[FusedMoEQuantConfig, FusedMoEModularKernel] = {}


def default_kernel(quant_config: FusedMoEQuantConfig) -> FusedMoEModularKernel:
    """``FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts(quant_config))``, one per config."""
    if quant_config not in _DEFAULT_KERNELS:
        _DEFAULT_KERNELS[quant_config] = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts(quant_config))
    return _DEFAULT_KERNELS[quant_config]


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    global_num_experts: int = -1,
    expert_map: torch.Tensor | None = None,
    inplace: bool = False,
    quant_config: FusedMoEQuantConfig | None = None,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[m] = sum_t topk_weights[m, t] * w2[e] @ (act(w1[e, :N] @ x[m]) * (w1[e, N:] @ x[m])), e = topk_ids[m, t].

    Args:
        hidden_states: (M, K) float16/bfloat16/float32.
        w1: (E, 2N, K), gate rows then up rows; w2: (E, K, N). Same dtype as hidden_states, or
            float8_e4m3fn with ``quant_config`` and ``w1_scale``/``w2_scale``.
        topk_weights: (M, topk) float32; topk_ids: (M, topk) int32/int64.
        activation: "silu", "gelu" (erf), "gelu_tanh" or "swigluoai".
        apply_router_weight_on_input: scale the input instead of the output (topk == 1).
        global_num_experts, expert_map: expert parallelism; expert_map (E_global,) int32 maps
            global ids to local ids or -1. Slots of remote or out-of-range experts contribute 0.
        inplace: write the result into ``hidden_states``.
        a1_scale/a2_scale: static per-tensor activation scales (dynamic when None).
        w1_bias (E, 2N) / w2_bias (E, K): optional expert biases, added before the activation
            and before the router weight.

    Returns:
        (M, K) tensor in hidden_states.dtype.

    Example:
        >>> w, ids = torch.topk(torch.softmax(logits, -1), 2)
        >>> out = tmoe.fused_experts(x, w1, w2, w, ids.int())
    """
    qc = quant_config or FusedMoEQuantConfig()
    args = (hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map, w1_scale,
            w2_scale, a1_scale, a2_scale, apply_router_weight_on_input, w1_bias, w2_bias, *qc.as_args())
    if inplace:
        torch.ops.tmoe.fused_experts_(*args)
        return hidden_states
    return torch.ops.tmoe.fused_experts(*args)
