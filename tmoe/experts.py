"""PermuteExpertsUnpermute implementations: Triton grouped GEMMs, Standard and Batched formats."""
from __future__ import annotations

import torch

from tmoe.config import get_config
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.moe_gemm import Routing, Scales, invoke_moe_gemm
from tmoe.modular import FusedMoEActivationFormat, FusedMoEPermuteExpertsUnpermute
from tmoe.quantize import quantize_activations

_STANDARD = FusedMoEActivationFormat.Standard
_BATCHED = FusedMoEActivationFormat.BatchedExperts


class _TritonExpertsBase(FusedMoEPermuteExpertsUnpermute):
    def supports_expert_map(self) -> bool:
        return True

    def _scales(self, a_scale: torch.Tensor | None, w_scale: torch.Tensor | None) -> Scales | None:
        if self.quant_config.quant_dtype is None:
            return None
        if a_scale is None or w_scale is None:
            raise ValueError("fp8 experts need activation scales and w1_scale/w2_scale")
        return Scales(a_scale, w_scale, self.quant_config.block_shape)

    def _config(self, m: int, e: int, n: int, k: int, topk: int, device: torch.device):
        qc = self.quant_config
        return get_config(m, e, n, k, topk, device, quant="fp8_w8a8" if qc.quant_dtype is not None else None,
                          block_k_cap=qc.block_shape[1] if qc.block_shape else None)


class TritonExperts(_TritonExpertsBase):
    """Standard format: align, fused up/gate GEMM with the activation, down GEMM; writes each
    slot's expert output to ``output`` (M, topk, K)."""

    @property
    def activation_formats(self):
        return (_STANDARD, _STANDARD)

    def supports_chunking(self) -> bool:
        return True

    def workspace_shapes(self, a, m, n, k, topk, num_experts, local_num_experts):
        return (m * topk, k), (m * topk, n), (m, topk, k)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, w1_scale, w2_scale, a1q_scale, a2_scale, workspace13, workspace2, expert_num_tokens,
              apply_router_weight_on_input, w1_bias=None, w2_bias=None) -> None:
        m, k = hidden_states.shape
        topk = topk_ids.shape[1]
        n = w1.shape[1] // 2
        cfg = self._config(m, global_num_experts, n, k, topk, hidden_states.device)
        sorted_ids, expert_ids, num_post_padded = moe_align_block_size(
            topk_ids, cfg.block_m, global_num_experts, expert_map
        )
        intermediate = workspace2.view(m * topk, n)
        weights = topk_weights.reshape(-1) if apply_router_weight_on_input else None
        invoke_moe_gemm(
            hidden_states, w1, intermediate, cfg.up, gated=True, activation=activation,
            routing=Routing(sorted_ids, expert_ids, num_post_padded, m * topk, topk),
            topk_weights=weights, scales=self._scales(a1q_scale, w1_scale), bias=w1_bias,
        )
        a2q, a2q_scale = quantize_activations(intermediate, self.quant_config, a2_scale)
        invoke_moe_gemm(
            a2q, w2, output.view(m * topk, k), cfg.down, gated=False,
            routing=Routing(sorted_ids, expert_ids, num_post_padded, m * topk, 1),
            scales=self._scales(a2q_scale, w2_scale), bias=w2_bias,
        )


class BatchedTritonExperts(_TritonExpertsBase):
    """BatchedExperts format: GEMMs over (E, max_tokens, K) batches that read each expert's
    token count from device memory."""

    def __init__(self, max_num_tokens: int, quant_config=None) -> None:
        super().__init__(quant_config)
        self.max_num_tokens = max_num_tokens

    @property
    def activation_formats(self):
        return (_BATCHED, _BATCHED)

    def workspace_shapes(self, a, m, n, k, topk, num_experts, local_num_experts):
        cap = self.max_num_tokens
        return (local_num_experts, cap, k), (local_num_experts, cap, n), (local_num_experts, cap, k)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, w1_scale, w2_scale, a1q_scale, a2_scale, workspace13, workspace2, expert_num_tokens,
              apply_router_weight_on_input, w1_bias=None, w2_bias=None) -> None:
        e, cap, k = hidden_states.shape
        n = w1.shape[1] // 2
        cfg = self._config(cap, e, n, k, 1, hidden_states.device)
        intermediate = workspace2.view(e, cap, n)
        invoke_moe_gemm(hidden_states, w1, intermediate, cfg.up, gated=True, activation=activation,
                        expert_num_tokens=expert_num_tokens, scales=self._scales(a1q_scale, w1_scale), bias=w1_bias)
        a2q, a2q_scale = quantize_activations(intermediate, self.quant_config, a2_scale)
        invoke_moe_gemm(a2q, w2, output, cfg.down, gated=False, expert_num_tokens=expert_num_tokens,
                        scales=self._scales(a2q_scale, w2_scale), bias=w2_bias)
