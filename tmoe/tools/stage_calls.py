"""What ``python -m tmoe bench --stages`` times besides the whole layer: each tmoe stage alone, on
the aligned (pointer) route or the grouped core's, and the two GEMMs of the peer beside it, each
chained as the layer runs them (one call per rotation set, ``RoutedInputs``)."""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

import tmoe
from tmoe.config import grouped_config, use_grouped_route
from tmoe.kernels.activation import Activation
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.moe_grouped_gemm import grouped_operands_fit, invoke_grouped_gemm
from tmoe.kernels.operands import Routing, Scales
from tmoe.kernels.sorted_rows import sorted_rows
from tmoe.modular.quantize import quantize_activations
from tmoe.tools.inputs import RoutedInputs
from tmoe.tools.peers import fp8_quant_config, quantize_rows, sort_by_expert, transposed
from tmoe.tools.timing import Call

STAGES = ("align", "up", "down", "reduce")
FP8_STAGES = ("quant", "align", "up", "quant_inter", "down", "reduce")  # fp8: the activation quantizations too
# every stage, in the layer's order: the grouped core adds the copy of the rows into expert order
STAGE_ORDER = ("quant", "align", "rows", "up", "quant_inter", "down", "reduce")
GEMM_PEERS = {"bf16": "grouped_mm", "fp8_token": "scaled_grouped_mm"}  # whose GEMMs run beside the grouped core's


def fp8_activation_quant(mode: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The tmoe op that quantizes activations in ``mode``: 1x128 groups (fp8_block) or per token."""
    ops = torch.ops.tmoe
    return functools.partial(ops.per_token_group_quant_fp8, group_size=128) if mode == "fp8_block" \
        else ops.per_token_quant_fp8


def stage_calls(w1: torch.Tensor, w2: torch.Tensor, sets: list[RoutedInputs], block_m: int, mode: str = "bf16",
                w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> dict[str, list[Call]]:
    """Per stage, one call per rotation set running that ``torch.ops.tmoe`` op alone on inputs
    made once by the stages before it (eagerly, here). fp8 modes (w1/w2 fp8 codes with their
    scales as ``quantize_fp8`` makes them) add the activation quantization before each GEMM,
    unfused: the layer may fold the intermediate's into the up GEMM's epilogue."""
    ops, e = torch.ops.tmoe, w1.shape[0]
    fp8 = mode != "bf16"
    calls: dict[str, list[Call]] = {s: [] for s in (FP8_STAGES if fp8 else STAGES)}
    quant = fp8_activation_quant(mode) if fp8 else None
    scaled = dict(block_shape=[128, 128] if mode == "fp8_block" else None, out_dtype=torch.bfloat16)
    for r in sets:
        m, topk = r.topk_ids.shape
        route = ops.moe_align_block_size(r.topk_ids, block_m, e)  # sorted ids, expert ids, padded count
        calls["align"].append(functools.partial(ops.moe_align_block_size, r.topk_ids, block_m, e))
        if fp8:
            x, x_scale = quant(r.x)
            up = functools.partial(ops.moe_gemm_up, x, w1, *route, topk, block_m, a_scale=x_scale, w_scale=w1_scale,
                                   **scaled)
            h = up()  # [M*topk, N] bf16
            inter, inter_scale = quant(h)
            down = functools.partial(ops.moe_gemm_down, inter, w2, *route, topk, block_m, a_scale=inter_scale,
                                     w_scale=w2_scale, **scaled)
            calls["quant"].append(functools.partial(quant, r.x))
            calls["quant_inter"].append(functools.partial(quant, h))
        else:
            up = functools.partial(ops.moe_gemm_up, r.x, w1, *route, topk, block_m)  # [M*topk, N]
            down = functools.partial(ops.moe_gemm_down, up(), w2, *route, topk, block_m)
        calls["up"].append(up)
        calls["down"].append(down)
        calls["reduce"].append(functools.partial(ops.moe_reduce, down().view(m, topk, -1), r.topk_ids, e,
                                                 r.topk_weights))
    return calls


def takes_grouped_route(w1: torch.Tensor, w2: torch.Tensor, m: int, topk: int, mode: str) -> bool:
    """Whether the layer runs an ``m``-token call on these weights on the grouped core
    (``TritonExperts``: ``use_grouped_route`` and operands TMA can read)."""
    return (use_grouped_route(m, topk, w1.shape[0], w2.shape[2], mode == "fp8_block")
            and grouped_operands_fit(w1, False) and grouped_operands_fit(w2))


def _per_token_config(mode: str) -> tmoe.FusedMoEQuantConfig | None:
    """The quantization of ``GEMM_PEERS``' modes: none (bf16), or per-token activations and
    per-channel weights (fp8_token)."""
    if mode not in GEMM_PEERS:
        raise ValueError(f"the grouped core and the GEMM peers are timed in {', '.join(GEMM_PEERS)}, not {mode}")
    return None if mode == "bf16" else fp8_quant_config(mode)


def grouped_stage_calls(w1: torch.Tensor, w2: torch.Tensor, sets: list[RoutedInputs], mode: str = "bf16",
                        w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                        ) -> dict[str, list[Call]]:
    """``stage_calls`` for the grouped core, as ``TritonExperts`` runs it: align at the core's
    block_m, the rows copied into expert order ("rows"), both GEMMs on the core, and in
    fp8_token (per-channel w1/w2 codes and scales) the activation quantizations (the
    intermediate's only of the rows the up GEMM wrote)."""
    qc = _per_token_config(mode)
    fp8 = qc is not None
    cfg, e, n = grouped_config(fp8=fp8), w1.shape[0], w2.shape[2]
    calls: dict[str, list[Call]] = {s: [] for s in STAGE_ORDER if fp8 or "quant" not in s}
    for r in sets:
        (m, k), topk = r.x.shape, r.topk_ids.shape[1]
        x, x_scale = quantize_activations(r.x, qc) if fp8 else (r.x, None)
        sorted_ids, expert_ids, padded = moe_align_block_size(r.topk_ids, cfg.block_m, e)
        up_rows = Routing(sorted_ids, expert_ids, padded, m * topk, topk)
        x_sorted = torch.empty((sorted_ids.shape[0], k), dtype=x.dtype, device=x.device)
        s_sorted = torch.empty((sorted_ids.shape[0], 1), dtype=torch.float32, device=x.device) if fp8 else None
        rows = functools.partial(sorted_rows, x, up_rows, x_sorted, x_scale.reshape(m, 1) if fp8 else None, s_sorted)
        inter = torch.empty((sorted_ids.shape[0], n), dtype=r.x.dtype, device=x.device)
        up = functools.partial(invoke_grouped_gemm, x_sorted, w1, inter, cfg.up, up_rows, gated=True,
                               activation=Activation(), scales=Scales(s_sorted, w1_scale) if fp8 else None)
        rows()
        up()
        a2, a2_scale = quantize_activations(inter, qc, num_rows=padded) if fp8 else (inter, None)
        y = torch.empty((m * topk, k), dtype=r.x.dtype, device=x.device)
        down = functools.partial(invoke_grouped_gemm, a2, w2, y, cfg.down,
                                 Routing(sorted_ids, expert_ids, padded, m * topk, 1), gated=False,
                                 scales=Scales(a2_scale, w2_scale) if fp8 else None)
        down()
        if fp8:
            calls["quant"].append(functools.partial(quantize_activations, r.x, qc))
            calls["quant_inter"].append(functools.partial(quantize_activations, inter, qc, num_rows=padded))
        calls["align"].append(functools.partial(moe_align_block_size, r.topk_ids, cfg.block_m, e))
        calls["rows"].append(rows)
        calls["up"].append(up)
        calls["down"].append(down)
        calls["reduce"].append(functools.partial(torch.ops.tmoe.moe_reduce, y.view(m, topk, k), r.topk_ids, e,
                                                 r.topk_weights))
    return calls


def peer_gemm_calls(w1: torch.Tensor, w2: torch.Tensor, sets: list[RoutedInputs], mode: str = "bf16",
                    w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                    ) -> dict[str, list[Call]]:
    """``GEMM_PEERS[mode]``'s two GEMMs alone, one call per rotation set, on the set's tokens in
    expert order (unpadded: one row per slot), as "<peer>.up" (gate and up, no activation) and
    "<peer>.down" (of silu(gate) * up): ``torch._grouped_mm`` (bf16 w1/w2), or
    ``torch._scaled_grouped_mm`` on tmoe's per-token fp8 codes and scales of the activations and
    the per-channel w1/w2 codes and scales (the intermediate quantized per row)."""
    qc = _per_token_config(mode)
    name = GEMM_PEERS[mode]
    calls: dict[str, list[Call]] = {f"{name}.up": [], f"{name}.down": []}
    for r in sets:
        x, x_scale = quantize_activations(r.x, qc) if qc is not None else (r.x, None)
        up, down = _peer_gemms(x, x_scale, w1, w1_scale, w2, w2_scale, r.topk_ids)
        calls[f"{name}.up"].append(up)
        calls[f"{name}.down"].append(down)
    return calls


def _peer_gemms(x: torch.Tensor, x_scale: torch.Tensor | None, w1: torch.Tensor, w1_scale: torch.Tensor | None,
                w2: torch.Tensor, w2_scale: torch.Tensor | None, topk_ids: torch.Tensor) -> tuple[Call, Call]:
    """``peer_gemm_calls`` of one set: ``x`` (M, K) bf16, or fp8 codes with ``x_scale`` (M, 1)."""
    n = w2.shape[2]
    _, token, offs = sort_by_expert(topk_ids, w1.shape[0])
    if x_scale is None:
        w1_t, w2_t = transposed(w1), transposed(w2)
        up = functools.partial(torch._grouped_mm, x[token], w1_t, offs=offs)
        h = up()
        down = functools.partial(torch._grouped_mm, F.silu(h[:, :n]) * h[:, n:], w2_t, offs=offs)
        return up, down
    scaled = dict(offs=offs, out_dtype=torch.bfloat16)
    up = functools.partial(torch._scaled_grouped_mm, x[token], w1.transpose(1, 2), x_scale.reshape(-1)[token],
                           w1_scale[..., 0], **scaled)
    h = up()
    aq, a_scale = quantize_rows(F.silu(h[:, :n]) * h[:, n:])
    return up, functools.partial(torch._scaled_grouped_mm, aq, w2.transpose(1, 2), a_scale, w2_scale[..., 0], **scaled)
