"""PermuteExpertsUnpermute implementations: Triton grouped GEMMs, Standard and Batched formats."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from tmoe.kernels.checks import positive_int
from tmoe.config import (
    GemmConfig, MoEConfig, direct_down_config, fused_decode_config, get_config, grouped_config, route_forced,
    use_direct_route, use_fused_route, use_grouped_route, use_slot_route,
)
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.operands import DirectRouting, Routing, Scales, WeightScales, operand_scales
from tmoe.kernels.moe_down_reduce import moe_down_reduce
from tmoe.kernels.moe_fused_decode import fused_decode_blocks, moe_fused_decode, moe_partial_reduce
from tmoe.kernels.moe_gemm import invoke_moe_gemm
from tmoe.kernels.moe_grouped_gemm import grouped_operands_fit, invoke_grouped_gemm
from tmoe.kernels.sorted_rows import sorted_rows
from tmoe.modular.call import LayerArgs
from tmoe.modular.interfaces import ExpertsCall, FusedMoEActivationFormat, FusedMoEPermuteExpertsUnpermute, Route
from tmoe.modular.lora_terms import lora_rows
from tmoe.modular.problem import MoEProblem
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

    def _fused_quant_group(self, n: int, up_block_n: int, a2_scale: torch.Tensor | None,
                           batch_invariant: bool) -> int | None:
        """The 1 x g group the up GEMM's epilogue quantizes the intermediate with, or None when
        the intermediate is written in the activation dtype and quantized by a separate stage (the
        two round differently; ``batch_invariant``: always the stage, as the wide tiles of large M)."""
        qc = self.quant_config
        if qc.scheme != "block" or a2_scale is not None or batch_invariant:
            return None
        g = qc.block_shape[1]
        return g if n % g == 0 and up_block_n % g == 0 else None

    def _up(self, call: ExpertsCall, x: torch.Tensor, a_scale: torch.Tensor | None, inter: torch.Tensor,
            up_cfg: GemmConfig, gemm: Callable[..., torch.Tensor], inter_rows: torch.Tensor | None = None,
            **route) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The up/gate GEMM of ``x`` (activation scales ``a_scale``) by ``gemm`` (``route``: its
        routing keywords) into ``inter`` (..., N), the intermediate in the activation dtype; returns
        it quantized for the down GEMM (fused into the epilogue when the tiles allow, then ``inter``
        is not written) and its scales; ``inter_rows`` ((1,) int32): the rows of ``inter`` the GEMM
        writes and the down GEMM reads, read on the device (the rest are not quantized). The
        epilogue also saves the pre-activation into ``call.preact`` when it is given."""
        n = inter.shape[-1]
        scales = self._scales(a_scale, call.w1_scale, call.w1_zp)
        kw = dict(gated=True, activation=call.activation, scales=scales, bias=call.w1_bias, **route)
        if call.w1_lora is not None:  # t = x @ A1[e].T of the unquantized rows
            rows = call.lora_rows if call.lora_rows is not None else x
            kw["lora"] = lora_rows(call.w1_lora, rows, call, gemm is invoke_grouped_gemm, route, up_cfg.block_m)
        if call.preact is not None:
            kw["pre_out"] = call.preact
        group = self._fused_quant_group(n, up_cfg.block_n, call.a2_scale, call.problem.batch_invariant)
        if call.w2_lora is not None:  # w2's adapter reads the intermediate unquantized: written, then quantized
            group = None
        if group is not None:
            inter_q = torch.empty(inter.shape, dtype=self.quant_config.quant_dtype, device=x.device)
            inter_scale = torch.empty((*inter.shape[:-1], n // group), dtype=torch.float32, device=x.device)
            gemm(x, call.w1, inter_q, up_cfg, out_scale=inter_scale, **kw)
            return inter_q, inter_scale
        gemm(x, call.w1, inter, up_cfg, **kw)
        return quantize_activations(inter, self.quant_config, call.a2_scale, num_rows=inter_rows)

    def _down(self, call: ExpertsCall, a2q: torch.Tensor, a2q_scale: torch.Tensor | None, out: torch.Tensor,
              down_cfg: GemmConfig, gemm: Callable[..., torch.Tensor], inter: torch.Tensor | None = None,
              **route) -> None:
        """The down GEMM of the quantized intermediate into ``out`` by ``gemm`` (``route``: its
        routing keywords); ``inter``: the intermediate before quantization, which w2's adapter reads."""
        scales = self._scales(a2q_scale, call.w2_scale, call.w2_zp)
        if call.w2_lora is not None:
            rows = inter if inter is not None and a2q.dtype != inter.dtype else a2q
            route = dict(route, lora=lora_rows(call.w2_lora, rows, call, gemm is invoke_grouped_gemm, route,
                                                  down_cfg.block_m))
        gemm(a2q, call.w2, out, down_cfg, gated=False, scales=scales, bias=call.w2_bias, **route)

    def _config(self, m: int, e: int, n: int, k: int, topk: int, device: torch.device,
                batch_invariant: bool) -> MoEConfig:
        qc = self.quant_config
        return get_config(m, e, n, k, topk, device, quant=qc.quant_name, block_shape=qc.block_shape,
                          group_size=qc.group_size or None, batch_invariant=batch_invariant)


class TritonExperts(_TritonExpertsBase):
    """Standard format, one route per chunk (``route``): SORTED aligns, then runs the fused
    up/gate GEMM with the activation and the down GEMM, writing each slot's expert output to
    ``output`` (M, topk, K); SLOTS skips the align (one row block per slot in both GEMMs); the
    decode routes write the weighted top-k sum into ``output`` (M, K): DIRECT (the down GEMM sums
    each token's slots) and FUSED (up, activation and down in one kernel, then a fixed-order sum)."""

    kind = "triton"

    @property
    def activation_formats(self):
        return (_STANDARD, _STANDARD)

    def supports_chunking(self) -> bool:
        return True

    def supports_lora(self) -> bool:
        return True

    def route(self, problem: MoEProblem, m: int, may_reduce: bool, args: LayerArgs, rows_copied: bool) -> Route:
        qc = self.quant_config
        # the slot route's 16-row fp8 tiles round unlike the mode's pinned ones (tmoe.config.invariant)
        fp8_pinned = problem.batch_invariant and qc.quant_dtype is not None and not route_forced()
        # the fused and direct routes sum a token's slots in float32 before rounding, the others round
        # each slot's output first: a batch-invariant call keeps to the second kind unless one is forced;
        # LoRA adapters run on the slot, sorted and grouped routes, whose epilogues add their term
        may_reduce = may_reduce and not problem.lora and not (problem.batch_invariant and not route_forced())
        if may_reduce and qc.quant_dtype is None and use_fused_route(m, problem.n, problem.k,
                                                                    low_bit=qc.weight_dtype is not None):
            return Route.FUSED
        if may_reduce and use_direct_route(m, problem.topk):
            return Route.DIRECT
        if use_slot_route(m) and not fp8_pinned:
            return Route.SLOTS
        if (use_grouped_route(m, problem.topk, problem.num_local_experts, problem.n, qc.scheme == "block")
                and not (problem.lora and qc.quant_dtype is not None)  # the adapters read the rows unquantized
                and not problem.lora_adapters  # one adapter per GEMM on the grouped core
                and self._grouped_fits(problem, args, rows_copied)):
            return Route.GROUPED
        return Route.SORTED

    def _grouped_fits(self, problem: MoEProblem, args: LayerArgs, rows_copied: bool) -> bool:
        """The grouped core reads both operands of both GEMMs by TMA: float or fp8 weights with K
        contiguous (not interleaved), prepared rows (hidden_states, or the new rows prepare copies:
        ``rows_copied``) contiguous and of 16-byte multiples, no expert map (the pointer route writes
        remote slots' zeros)."""
        qc, x = self.quant_config, args.hidden_states
        size = 1 if qc.quant_dtype is not None else x.element_size()  # fp8 rows once quantized
        rows_fit = (rows_copied or x.stride(1) == 1) and all(d * size % 16 == 0 for d in (problem.k, problem.n))
        return (args.expert_map is None and qc.weight_dtype is None and rows_fit
                and grouped_operands_fit(args.w1, problem.activation.interleaved) and grouped_operands_fit(args.w2))

    def workspace_shapes(self, a, m, n, k, topk, num_experts, local_num_experts):
        return (m * topk, k), (m * topk, n), (m, topk, k)

    def apply(self, output: torch.Tensor, call: ExpertsCall, workspace13: torch.Tensor,
              workspace2: torch.Tensor) -> None:
        match call.route:
            case Route.FUSED:
                self._fused_decode(output, call)
            case Route.DIRECT:
                self._direct(output, call, workspace2)
            case Route.SLOTS:
                self._slots(output, call, workspace2)
            case Route.SORTED:
                self._sorted(output, call, workspace2)
            case Route.GROUPED:
                self._grouped(output, call, workspace2)
            case route:
                raise ValueError(f"TritonExperts has no route {route.name}")

    def _layer_config(self, call: ExpertsCall) -> MoEConfig:
        m, k = call.hidden_states.shape
        return self._config(m, call.num_experts, call.n, k, call.topk_ids.shape[1], call.hidden_states.device,
                            call.problem.batch_invariant)

    @staticmethod
    def _input_weights(call: ExpertsCall) -> torch.Tensor | None:
        """The router weights the up GEMM applies to its input (apply_router_weight_on_input)."""
        return call.topk_weights.reshape(-1) if call.apply_router_weight_on_input else None

    def _fused_decode(self, output: torch.Tensor, call: ExpertsCall) -> None:
        """Partial sums per (slot, intermediate block), then their reduce into output (M, K)."""
        x = call.hidden_states
        m, k = x.shape
        cfg = fused_decode_config(m, call.n, k, call.topk_ids.shape[1], x.device, call.problem.batch_invariant)
        partial = torch.empty((call.topk_ids.numel(), fused_decode_blocks(call.n, cfg), k), dtype=torch.float32,
                              device=x.device)
        moe_fused_decode(x, call.w1, call.w2, partial, call.topk_ids, call.num_experts, cfg, n=call.n,
                         activation=call.activation,
                         topk_weights=call.topk_weights, weight_on_input=call.apply_router_weight_on_input,
                         expert_map=call.expert_map, w1_scales=self._scales(None, call.w1_scale, call.w1_zp),
                         w2_scales=self._scales(None, call.w2_scale, call.w2_zp), w1_bias=call.w1_bias,
                         w2_bias=call.w2_bias)
        moe_partial_reduce(partial, call.topk_ids, call.num_experts, output, expert_map=call.expert_map,
                           num_local_experts=call.problem.num_local_experts)

    def _slot_up(self, call: ExpertsCall, cfg: MoEConfig, workspace2: torch.Tensor):
        """The up GEMM with no align: slot s is row block s."""
        m, topk = call.topk_ids.shape
        return self._up(call, call.hidden_states, call.a1q_scale, workspace2.view(m * topk, call.n),
                        replace(cfg.up, block_m=16), invoke_moe_gemm,
                        routing=DirectRouting(call.topk_ids, call.num_experts, call.expert_map, topk), route=call.route,
                        topk_weights=self._input_weights(call))

    def _direct(self, output: torch.Tensor, call: ExpertsCall, workspace2: torch.Tensor) -> None:
        """Decode: the down GEMM sums each token's slots into output (M, K)."""
        cfg = self._layer_config(call)
        a2q, a2q_scale = self._slot_up(call, cfg, workspace2)
        m, k = call.hidden_states.shape
        down_cfg = direct_down_config(cfg, m, k, call.hidden_states.device, self.quant_config.block_shape)
        moe_down_reduce(a2q, call.w2, output, call.topk_ids, call.num_experts, down_cfg,
                        topk_weights=None if call.apply_router_weight_on_input else call.topk_weights,
                        expert_map=call.expert_map, scales=self._scales(a2q_scale, call.w2_scale, call.w2_zp),
                        bias=call.w2_bias)

    def _slots(self, output: torch.Tensor, call: ExpertsCall, workspace2: torch.Tensor) -> None:
        """No align: the down GEMM per slot too (output (M, topk, K)); the top-k reduce follows."""
        cfg = self._layer_config(call)
        a2q, a2q_scale = self._slot_up(call, cfg, workspace2)
        m, topk = call.topk_ids.shape
        self._down(call, a2q, a2q_scale, output.view(m * topk, -1), replace(cfg.down, block_m=16), invoke_moe_gemm,
                   inter=workspace2.view(m * topk, call.n),
                   routing=DirectRouting(call.topk_ids, call.num_experts, call.expert_map, 1), route=call.route)

    def _sorted(self, output: torch.Tensor, call: ExpertsCall, workspace2: torch.Tensor) -> None:
        """Align the slots by expert, then both GEMMs over the sorted slots with pointer-gathered
        rows (output (M, topk, K))."""
        m, topk = call.topk_ids.shape
        cfg = self._layer_config(call)
        sorted_ids, expert_ids, num_post_padded = moe_align_block_size(
            call.topk_ids, cfg.block_m, call.num_experts, call.expert_map, num_local_experts=call.problem.num_local_experts
        )
        a2q, a2q_scale = self._up(call, call.hidden_states, call.a1q_scale, workspace2.view(m * topk, call.n), cfg.up,
                                  invoke_moe_gemm, routing=Routing(sorted_ids, expert_ids, num_post_padded, m * topk, topk),
                                  route=call.route,
                                  topk_weights=self._input_weights(call))
        self._down(call, a2q, a2q_scale, output.view(m * topk, -1), cfg.down, invoke_moe_gemm,
                   inter=workspace2.view(m * topk, call.n),
                   routing=Routing(sorted_ids, expert_ids, num_post_padded, m * topk, 1), route=call.route)

    def _grouped(self, output: torch.Tensor, call: ExpertsCall, workspace2: torch.Tensor) -> None:
        """Align with the grouped core's block_m, copy the rows (and fp8 scales) into sorted order,
        then both GEMMs on the grouped core: the intermediate (``workspace2``'s dtype unless the
        epilogue quantizes it) stays in sorted order, the down GEMM writes each slot's row of
        ``output`` (M, topk, K)."""
        x = call.hidden_states
        (m, k), topk, n = x.shape, call.topk_ids.shape[1], call.n
        qc = self.quant_config
        cfg = grouped_config(qc.block_shape, fp8=qc.quant_dtype is not None)
        sorted_ids, expert_ids, num_post_padded = moe_align_block_size(
            call.topk_ids, cfg.block_m, call.num_experts, num_local_experts=call.problem.num_local_experts)
        em = sorted_ids.shape[0]
        up_rows = Routing(sorted_ids, expert_ids, num_post_padded, m * topk, topk)
        a_scale = call.a1q_scale
        x_sorted = torch.empty((em, k), dtype=x.dtype, device=x.device)
        if a_scale is not None and a_scale.numel() > 1:  # per token or per block: sorted with the rows
            a_scale_rows = a_scale.reshape(m, -1)
            a_scale = torch.empty((em, a_scale_rows.shape[1]), dtype=torch.float32, device=x.device)
            sorted_rows(x, up_rows, x_sorted, a_scale_rows, a_scale)
        else:
            sorted_rows(x, up_rows, x_sorted)
        inter = torch.empty((em, n), dtype=workspace2.dtype, device=x.device)
        a2q, a2q_scale = self._up(call, x_sorted, a_scale, inter, cfg.up, invoke_grouped_gemm,
                                  inter_rows=num_post_padded, routing=up_rows, topk_weights=self._input_weights(call))
        self._down(call, a2q, a2q_scale, output.view(m * topk, -1), cfg.down, invoke_grouped_gemm,
                   routing=Routing(sorted_ids, expert_ids, num_post_padded, m * topk, 1))


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

    def route(self, problem: MoEProblem, m: int, may_reduce: bool, args: LayerArgs, rows_copied: bool) -> Route:
        return Route.BATCHED

    def workspace_shapes(self, a, m, n, k, topk, num_experts, local_num_experts):
        cap = self.capacity
        return (local_num_experts, cap, k), (local_num_experts, cap, n), (local_num_experts, cap, k)

    def apply(self, output: torch.Tensor, call: ExpertsCall, workspace13: torch.Tensor,
              workspace2: torch.Tensor) -> None:
        if call.route is not Route.BATCHED:
            raise ValueError(f"BatchedTritonExperts has no route {call.route.name}")
        e, cap, k = call.hidden_states.shape
        cfg = self._config(cap, e, call.n, k, 1, call.hidden_states.device, call.problem.batch_invariant)
        counts = call.expert_num_tokens
        a2q, a2q_scale = self._up(call, call.hidden_states, call.a1q_scale, workspace2.view(e, cap, call.n), cfg.up,
                                  invoke_moe_gemm, expert_num_tokens=counts, route=call.route)
        self._down(call, a2q, a2q_scale, output, cfg.down, invoke_moe_gemm, expert_num_tokens=counts, route=call.route)
