"""PermuteExpertsUnpermute implementations: Triton grouped GEMMs, Standard and Batched formats."""
from __future__ import annotations

from dataclasses import replace

import torch

from tmoe.kernels.checks import positive_int
from tmoe.config import (
    GemmConfig, direct_down_config, fused_decode_config, get_config, use_direct_route, use_fused_route, use_slot_route,
)
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.activation import w1_rows_per_n
from tmoe.kernels.operands import DirectRouting, Routing, Scales, WeightScales, operand_scales
from tmoe.kernels.moe_down_reduce import moe_down_reduce
from tmoe.kernels.moe_fused_decode import fused_decode_blocks, moe_fused_decode, moe_partial_reduce
from tmoe.kernels.moe_gemm import invoke_moe_gemm
from tmoe.modular.interfaces import FusedMoEActivationFormat, FusedMoEPermuteExpertsUnpermute
from tmoe.modular.quantize import quantize_activations

_STANDARD = FusedMoEActivationFormat.Standard
_BATCHED = FusedMoEActivationFormat.BatchedExperts


class _TritonExpertsBase(FusedMoEPermuteExpertsUnpermute):
    def supports_expert_map(self) -> bool:
        return True

    def _scales(self, a_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
                w_zp: torch.Tensor | None = None) -> Scales | WeightScales | None:
        qc = self.quant_config
        return operand_scales(a_scale, w_scale, qc.block_shape, w_zp, qc.weight_dtype, qc.group_size,
                              fp8=qc.quant_dtype is not None,
                              missing="fp8 experts need activation scales and w1_scale/w2_scale")

    def _fused_quant_group(self, n: int, up_block_n: int, a2_scale: torch.Tensor | None) -> int | None:
        """The 1 x g group the up GEMM's epilogue quantizes the intermediate with, or None when
        the intermediate is written in the activation dtype and quantized by a separate stage."""
        qc = self.quant_config
        if qc.scheme != "block" or a2_scale is not None:
            return None
        g = qc.block_shape[1]
        return g if n % g == 0 and up_block_n % g == 0 else None

    def _up(self, hidden_states, w1, shape: tuple[int, ...], workspace2, up_cfg: GemmConfig, a1q_scale, w1_scale,
            a2_scale, w1_zp=None, **gemm) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The up/gate GEMM into an intermediate of ``shape``; returns it quantized for the down
        GEMM (fused into the epilogue when the tiles allow) and its scales."""
        n = shape[-1]
        scales = self._scales(a1q_scale, w1_scale, w1_zp)
        group = self._fused_quant_group(n, up_cfg.block_n, a2_scale)
        if group is not None:
            inter = torch.empty(shape, dtype=self.quant_config.quant_dtype, device=hidden_states.device)
            inter_scale = torch.empty((*shape[:-1], n // group), dtype=torch.float32, device=hidden_states.device)
            invoke_moe_gemm(hidden_states, w1, inter, up_cfg, gated=True, scales=scales, out_scale=inter_scale, **gemm)
            return inter, inter_scale
        inter = workspace2.view(shape)
        invoke_moe_gemm(hidden_states, w1, inter, up_cfg, gated=True, scales=scales, **gemm)
        return quantize_activations(inter, self.quant_config, a2_scale)

    def _config(self, m: int, e: int, n: int, k: int, topk: int, device: torch.device):
        qc = self.quant_config
        return get_config(m, e, n, k, topk, device, quant=qc.quant_name, block_shape=qc.block_shape,
                          group_size=qc.group_size or None)


class TritonExperts(_TritonExpertsBase):
    """Standard format: align, fused up/gate GEMM with the activation, down GEMM; writes each
    slot's expert output to ``output`` (M, topk, K) (``use_slot_route``: no align, one row block
    per slot in both GEMMs). Decode (``reduces_topk``; ``output`` is (M, K)): no align, one row
    block per slot, and the down GEMM writes the weighted top-k sum."""

    kind = "triton"

    @property
    def activation_formats(self):
        return (_STANDARD, _STANDARD)

    def supports_chunking(self) -> bool:
        return True

    def reduces_topk(self, m: int, topk: int, n: int, k: int) -> bool:
        return use_direct_route(m, topk) or self._fused(m, n, k)

    def _fused(self, m: int, n: int, k: int) -> bool:
        qc = self.quant_config
        return qc.quant_dtype is None and use_fused_route(m, n, k, low_bit=qc.weight_dtype is not None)

    def _fused_decode(self, n, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                      expert_map, w1_scale, w2_scale, apply_router_weight_on_input, w1_bias, w2_bias, w1_zp, w2_zp,
                      **act_options) -> None:
        """The fused decode path (intermediate size ``n``): partial sums per (slot, intermediate block),
        then their reduce into output (M, K)."""
        m, k = hidden_states.shape
        cfg = fused_decode_config(m, n, k, topk_ids.shape[1], hidden_states.device)
        partial = torch.empty((topk_ids.numel(), fused_decode_blocks(n, cfg), k), dtype=torch.float32,
                              device=hidden_states.device)
        moe_fused_decode(hidden_states, w1, w2, partial, topk_ids, global_num_experts, cfg, activation=activation,
                         topk_weights=topk_weights, weight_on_input=apply_router_weight_on_input,
                         expert_map=expert_map, w1_scales=self._scales(None, w1_scale, w1_zp),
                         w2_scales=self._scales(None, w2_scale, w2_zp), w1_bias=w1_bias, w2_bias=w2_bias,
                         **act_options)
        moe_partial_reduce(partial, topk_ids, global_num_experts, output, expert_map=expert_map,
                           num_local_experts=w1.shape[0])

    def workspace_shapes(self, a, m, n, k, topk, num_experts, local_num_experts):
        return (m * topk, k), (m * topk, n), (m, topk, k)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, w1_scale, w2_scale, a1q_scale, a2_scale, workspace13, workspace2, expert_num_tokens,
              apply_router_weight_on_input, w1_bias=None, w2_bias=None, w1_zp=None, w2_zp=None,
              **act_options) -> None:
        m, k = hidden_states.shape
        n = w1.shape[1] // w1_rows_per_n(activation)
        if output.dim() == 2 and self._fused(m, n, k):
            self._fused_decode(n, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                               expert_map, w1_scale, w2_scale, apply_router_weight_on_input, w1_bias, w2_bias,
                               w1_zp, w2_zp, **act_options)
            return
        topk = topk_ids.shape[1]
        cfg = self._config(m, global_num_experts, n, k, topk, hidden_states.device)
        weights = topk_weights.reshape(-1) if apply_router_weight_on_input else None
        if output.dim() == 2 or use_slot_route(m):  # no align: slot s is row block s of the up GEMM
            a2q, a2q_scale = self._up(
                hidden_states, w1, (m * topk, n), workspace2, replace(cfg.up, block_m=16), a1q_scale, w1_scale,
                a2_scale, w1_zp, activation=activation, topk_weights=weights, bias=w1_bias,
                routing=DirectRouting(topk_ids, global_num_experts, expert_map, topk), **act_options,
            )
            scales = self._scales(a2q_scale, w2_scale, w2_zp)
            if output.dim() == 2:  # decode: the down GEMM sums each token's slots
                down_cfg = direct_down_config(cfg, m, k, hidden_states.device, self.quant_config.block_shape)
                moe_down_reduce(a2q, w2, output, topk_ids, global_num_experts, down_cfg,
                                topk_weights=None if apply_router_weight_on_input else topk_weights,
                                expert_map=expert_map, scales=scales, bias=w2_bias)
            else:  # slots: the down GEMM per slot too, the top-k reduce after
                invoke_moe_gemm(a2q, w2, output.view(m * topk, k), replace(cfg.down, block_m=16), gated=False,
                                routing=DirectRouting(topk_ids, global_num_experts, expert_map, 1), scales=scales,
                                bias=w2_bias)
            return
        sorted_ids, expert_ids, num_post_padded = moe_align_block_size(
            topk_ids, cfg.block_m, global_num_experts, expert_map, num_local_experts=w1.shape[0]
        )
        a2q, a2q_scale = self._up(
            hidden_states, w1, (m * topk, n), workspace2, cfg.up, a1q_scale, w1_scale, a2_scale, w1_zp,
            activation=activation, routing=Routing(sorted_ids, expert_ids, num_post_padded, m * topk, topk),
            topk_weights=weights, bias=w1_bias, **act_options,
        )
        invoke_moe_gemm(
            a2q, w2, output.view(m * topk, k), cfg.down, gated=False,
            routing=Routing(sorted_ids, expert_ids, num_post_padded, m * topk, 1),
            scales=self._scales(a2q_scale, w2_scale, w2_zp), bias=w2_bias,
        )


class BatchedTritonExperts(_TritonExpertsBase):
    """BatchedExperts format: GEMMs over (E, max_tokens, K) batches that read each expert's
    token count from device memory."""

    kind = "batched_triton"

    def __init__(self, max_num_tokens: int, quant_config=None) -> None:
        super().__init__(quant_config)
        self.capacity = positive_int("max_num_tokens", max_num_tokens)

    def op_args(self) -> tuple[int, ...]:
        return (self.capacity,)

    def max_num_tokens(self) -> int:
        return self.capacity

    @property
    def activation_formats(self):
        return (_BATCHED, _BATCHED)

    def workspace_shapes(self, a, m, n, k, topk, num_experts, local_num_experts):
        cap = self.capacity
        return (local_num_experts, cap, k), (local_num_experts, cap, n), (local_num_experts, cap, k)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, w1_scale, w2_scale, a1q_scale, a2_scale, workspace13, workspace2, expert_num_tokens,
              apply_router_weight_on_input, w1_bias=None, w2_bias=None, w1_zp=None, w2_zp=None,
              **act_options) -> None:
        e, cap, k = hidden_states.shape
        n = w1.shape[1] // w1_rows_per_n(activation)
        cfg = self._config(cap, e, n, k, 1, hidden_states.device)
        a2q, a2q_scale = self._up(hidden_states, w1, (e, cap, n), workspace2, cfg.up, a1q_scale, w1_scale, a2_scale,
                                  w1_zp, activation=activation, expert_num_tokens=expert_num_tokens, bias=w1_bias,
                                  **act_options)
        invoke_moe_gemm(a2q, w2, output, cfg.down, gated=False, expert_num_tokens=expert_num_tokens,
                        scales=self._scales(a2q_scale, w2_scale, w2_zp), bias=w2_bias)
