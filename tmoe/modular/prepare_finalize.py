"""PrepareAndFinalize implementations: single device (Standard) and fixed-capacity batches."""
from __future__ import annotations

from tmoe.kernels.checks import positive_int
from tmoe.kernels.dispatch import batched_dispatch
from tmoe.kernels.reduce import moe_reduce
from tmoe.modular.interfaces import FusedMoEActivationFormat, FusedMoEPrepareAndFinalize, PrepareResult
from tmoe.modular.quant_config import FusedMoEQuantConfig
from tmoe.modular.quantize import quantize_activations



class NoEPPrepareAndFinalize(FusedMoEPrepareAndFinalize):
    """One device, no expert parallelism: prepare quantizes (or passes through); finalize is
    the weighted top-k reduce, or nothing when the experts wrote the reduced output."""

    kind = "noep"

    @property
    def activation_format(self) -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, a1_scale=None) -> PrepareResult:
        a1q, scale = quantize_activations(a1, quant_config, a1_scale)
        return PrepareResult(a1q, scale)

    def accepts_reduced_output(self) -> bool:
        return True

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input, *,
                 num_experts, expert_map, prepared, num_local_experts, reduced=False) -> None:
        if reduced:  # the experts wrote the weighted sum into output itself
            return
        weights = None if apply_router_weight_on_input else topk_weights
        moe_reduce(fused_expert_output, topk_ids, num_experts, weights, expert_map, out=output,
                   num_local_experts=num_local_experts)


class BatchedPrepareAndFinalize(FusedMoEPrepareAndFinalize):
    """Scatter tokens into ``(local_experts, max_num_tokens, K)`` batches with per-expert device
    counts: the layout of low-latency expert-parallel all-to-all. An expert's slots beyond
    ``max_num_tokens`` are dropped, keeping the lowest slot indices; dropped slots contribute
    zero to the output. ``num_local_experts`` must equal the experts' w1.shape[0]."""

    kind = "batched"

    def __init__(self, max_num_tokens: int, num_local_experts: int) -> None:
        self.max_num_tokens = positive_int("max_num_tokens", max_num_tokens)
        self.num_local_experts = positive_int("num_local_experts", num_local_experts)

    def op_args(self) -> tuple[int, ...]:
        return (self.max_num_tokens, self.num_local_experts)

    def check_local_experts(self, num_local_experts: int) -> None:
        if num_local_experts != self.num_local_experts:
            raise ValueError(f"BatchedPrepareAndFinalize(num_local_experts={self.num_local_experts}) does not match "
                             f"the {num_local_experts} experts of w1/w2")

    @property
    def activation_format(self) -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.BatchedExperts

    def max_num_tokens_per_rank(self) -> int:
        return self.max_num_tokens

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config: FusedMoEQuantConfig, a1_scale=None) -> PrepareResult:
        if apply_router_weight_on_input:
            raise ValueError("apply_router_weight_on_input is not supported by BatchedPrepareAndFinalize")
        a1q, scale = quantize_activations(a1, quant_config, a1_scale)
        # dynamic scales belong to rows (per token or per group) and travel with them, even when
        # there is one token; a static per-tensor scale applies to every batch as it is
        row_scale = scale if scale is not None and a1_scale is None else None
        batches, batch_scale, expert_num_tokens, rows = batched_dispatch(
            a1q, topk_ids, num_experts, self.num_local_experts, self.max_num_tokens,
            x_scale=row_scale, expert_map=expert_map,
        )
        return PrepareResult(batches, batch_scale if row_scale is not None else scale, expert_num_tokens, rows)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input, *,
                 num_experts, expert_map, prepared, num_local_experts, reduced=False) -> None:
        flat = fused_expert_output.reshape(-1, fused_expert_output.shape[-1])
        moe_reduce(flat, topk_ids, num_experts, topk_weights, None, out=output, rows=prepared.dispatch_rows)
