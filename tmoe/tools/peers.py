"""What ``tmoe.benchmark`` runs on the GPU: inputs and providers (the tmoe layer, its stages, two
plain-PyTorch bf16 peers and one fp8 peer); the ceilings and the timers are in ``timing.py``.

Every provider maps one ``RoutedInputs`` to the (M, K) layer output. Peers follow the layout
``tmoe.fused_experts`` takes: w1 (E, 2N, K) gate rows then up rows, w2 (E, K, N), silu.
"""
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
from tmoe.tools.inputs import Provider, RoutedInputs
from tmoe.tools.low_bit import LOW_BIT_DTYPES, low_bit_providers
from tmoe.tools.timing import Call
from tmoe.weights import quantize_weight_per_block_fp8, quantize_weight_per_channel_fp8

FP8_MODES = ("fp8_block", "fp8_token")


def _sort_by_expert(topk_ids: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, token, offs): the M*topk slots in expert order, their token rows, int32 group ends (E,).

    Group ends are ``searchsorted`` on the sorted ids, equal to
    ``bincount(ids, minlength=E).cumsum(0)``; bincount reads its max on the host, this does not,
    so the peers can be graph-captured.
    """
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [M*topk]
    experts = torch.arange(e, dtype=flat.dtype, device=flat.device)
    offs = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)  # [E]
    return order, order // topk_ids.shape[1], offs


def grouped_mm_moe(x: torch.Tensor, w1_t: torch.Tensor, w2_t: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """Sort slots by expert, ``torch._grouped_mm`` up, silu(gate) * up, ``_grouped_mm`` down,
    weighted ``index_add_``. w1_t (E, K, 2N), w2_t (E, N, K): transposed views of w1, w2."""
    n = w2_t.shape[1]
    order, token, offs = _sort_by_expert(topk_ids, w1_t.shape[0])
    h = torch._grouped_mm(x[token], w1_t, offs=offs)  # [M*topk, 2N]
    a = F.silu(h[:, :n]) * h[:, n:]
    y = torch._grouped_mm(a, w2_t, offs=offs)  # [M*topk, K]
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def _quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t (R, C) -> (float8_e4m3fn codes (R, C), float32 scales (R,)), scale = max(absmax / 448, 1e-12)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = (t.abs().amax(-1).float() / fp8_max).clamp(min=1e-12)
    return (t.float() / scale[:, None]).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


Fp8Weight = tuple[torch.Tensor, torch.Tensor]  # (E, In, Out) float8_e4m3fn column-major, (E, Out) float32


def scaled_grouped_mm_moe(x: torch.Tensor, w1: Fp8Weight, w2: Fp8Weight, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
    """``grouped_mm_moe`` in fp8 with ``torch._scaled_grouped_mm`` and row-wise scales: the gathered
    tokens (before the gather, once per token) and the intermediate rows are quantized per row in
    plain torch before each GEMM.
    w1 = (w1q_t (E, K, 2N), s1 (E, 2N)), w2 = (w2q_t (E, N, K), s2 (E, K)): transposed views of
    the per-output-channel fp8 w1, w2 and their scales. Returns (M, K) bf16."""
    (w1q_t, s1), (w2q_t, s2) = w1, w2
    n = w2q_t.shape[1]
    order, token, offs = _sort_by_expert(topk_ids, w1q_t.shape[0])
    xq, x_scale = _quantize_rows(x)  # [M, K], [M]: quantized once per token, then gathered
    xq, x_scale = xq[token], x_scale[token]  # [M*topk, K], [M*topk]
    h = torch._scaled_grouped_mm(xq, w1q_t, x_scale, s1, offs=offs, out_dtype=torch.bfloat16)  # [M*topk, 2N]
    aq, a_scale = _quantize_rows(F.silu(h[:, :n]) * h[:, n:])  # [M*topk, N], [M*topk]
    y = torch._scaled_grouped_mm(aq, w2q_t, a_scale, s2, offs=offs, out_dtype=torch.bfloat16)  # [M*topk, K]
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def loop_moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor) -> torch.Tensor:
    """The per-expert Python loop: gather the expert's tokens, two matmuls, weighted index_add_.
    Syncs on every expert (nonzero)."""
    n = w2.shape[2]
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        rows, cols = (topk_ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = x[rows] @ w1[e].T
        y = (F.silu(h[:, :n]) * h[:, n:]) @ w2[e].T
        out.index_add_(0, rows, y * topk_weights[rows, cols, None].to(y.dtype))
    return out


@functools.lru_cache(maxsize=None)
def _grouped_mm_takes_views(device: torch.device) -> bool:
    """Whether ``_grouped_mm`` accepts a transposed (column-major) view of a contiguous weight."""
    a = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    w = torch.randn(2, 64, 64, dtype=torch.bfloat16, device=device)
    try:
        torch._grouped_mm(a, w.transpose(1, 2), offs=torch.tensor([8, 16], dtype=torch.int32, device=device))
        return True
    except RuntimeError:
        return False


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """(E, A, B) -> (E, B, A): a view when ``_grouped_mm`` takes one, else a contiguous copy (made once)."""
    t = w.transpose(1, 2)
    return t if _grouped_mm_takes_views(w.device) else t.contiguous()


def bf16_providers(w1: torch.Tensor, w2: torch.Tensor, names: tuple[str, ...]) -> list[Provider]:
    """The bf16 providers among "tmoe", "grouped_mm", "loop", in that order."""
    providers = []
    if "tmoe" in names:
        providers.append(Provider("tmoe", lambda r: tmoe.fused_experts(r.x, w1, w2, r.topk_weights, r.topk_ids)))
    if "grouped_mm" in names:
        try:
            w1_t, w2_t = _transposed(w1), _transposed(w2)
            fn = lambda r: grouped_mm_moe(r.x, w1_t, w2_t, r.topk_weights, r.topk_ids)  # noqa: E731
        except Exception as err:  # noqa: BLE001  (a peer that fails is reported, not fatal)
            fn = failing(err)
        providers.append(Provider("grouped_mm", fn))
    if "loop" in names:
        providers.append(Provider("loop", lambda r: loop_moe(r.x, w1, w2, r.topk_weights, r.topk_ids), syncs=True))
    return providers


def failing(err: Exception) -> Callable[[RoutedInputs], torch.Tensor]:
    def fn(_: RoutedInputs) -> torch.Tensor:
        raise err
    return fn


def quantize_fp8(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, A, B) bf16 -> (fp8 codes, float32 scales), one expert at a time to bound float32
    temporaries. fp8_block: 128x128 block scales (E, A/128, B/128); fp8_token: per channel (E, A, 1)."""

    quantize = quantize_weight_per_block_fp8 if mode == "fp8_block" else quantize_weight_per_channel_fp8
    q0, s0 = quantize(w[:1])
    q = torch.empty((w.shape[0], *q0.shape[1:]), dtype=q0.dtype, device=w.device)
    s = torch.empty((w.shape[0], *s0.shape[1:]), dtype=s0.dtype, device=w.device)
    for i in range(w.shape[0]):
        q[i : i + 1], s[i : i + 1] = quantize(w[i : i + 1])
    return q, s


def fp8_quant_config(mode: str) -> tmoe.FusedMoEQuantConfig:
    """The layer's fp8 scheme of ``mode``: 128 x 128 weight blocks with 1 x 128 activation groups
    (fp8_block), or per-channel weights and per-token activations (fp8_token)."""
    if mode == "fp8_block":
        return tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(128, 128))
    return tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, per_act_token_quant=True, per_out_ch_quant=True)


def fp8_provider(w1: torch.Tensor, w2: torch.Tensor, mode: str) -> Provider:
    """The tmoe layer on fp8 weights quantized from w1/w2 (which the caller may then free);
    activations are quantized inside the call. Named "tmoe"."""
    qc = fp8_quant_config(mode)
    (w1q, s1), (w2q, s2) = quantize_fp8(w1, mode), quantize_fp8(w2, mode)

    def fn(r: RoutedInputs) -> torch.Tensor:
        return tmoe.fused_experts(r.x, w1q, w2q, r.topk_weights, r.topk_ids, quant_config=qc, w1_scale=s1,
                                  w2_scale=s2)

    return Provider("tmoe", fn)


def scaled_grouped_mm_provider(w1: torch.Tensor, w2: torch.Tensor) -> Provider:
    """``scaled_grouped_mm_moe`` on w1/w2 quantized per output channel once, here; named
    "scaled_grouped_mm". Row-wise in both fp8 modes: per-token activation and per-channel weight
    scales, also where tmoe's fp8_block uses 128x128 weight blocks. A failing setup gives a
    provider that raises."""
    try:
        (w1q, s1), (w2q, s2) = quantize_fp8(w1, "fp8_token"), quantize_fp8(w2, "fp8_token")
        up, down = (w1q.transpose(1, 2), s1[..., 0]), (w2q.transpose(1, 2), s2[..., 0])
        fn = lambda r: scaled_grouped_mm_moe(r.x, up, down, r.topk_weights, r.topk_ids)  # noqa: E731
    except Exception as err:  # noqa: BLE001  (a peer that fails is reported, not fatal)
        fn = failing(err)
    return Provider("scaled_grouped_mm", fn)


def with_routes(providers: list[Provider], routes: tuple[str, ...]) -> list[Provider]:
    """The "tmoe" provider once per route: "auto" as it is, "sorted"/"direct" forced to the
    aligned or decode path and named "tmoe[sorted]"/"tmoe[direct]"; other providers unchanged."""
    def forced(fn: Callable[[RoutedInputs], torch.Tensor], route: str) -> Callable[[RoutedInputs], torch.Tensor]:
        def call(r: RoutedInputs) -> torch.Tensor:
            with tmoe.override_route(route):
                return fn(r)
        return call

    out = []
    for p in providers:
        if p.name != "tmoe":
            out.append(p)
            continue
        out += [p if r == "auto" else Provider(f"tmoe[{r}]", forced(p.fn, r), p.syncs) for r in routes]
    return out


def providers(dtype: str, w1: torch.Tensor, w2: torch.Tensor, names: tuple[str, ...]) -> list[Provider]:
    """The providers of a run: ``bf16_providers`` for "bf16", ``low_bit_providers`` for int4, int8
    and mxfp4, else those among the fp8 tmoe layer and "scaled_grouped_mm" (a failing fp8 setup
    gives a provider that raises, reported as n/a)."""
    if dtype == "bf16":
        return bf16_providers(w1, w2, names)
    if dtype in LOW_BIT_DTYPES:
        return low_bit_providers(w1, w2, dtype, names)
    fp8 = []
    if "tmoe" in names:
        try:
            fp8.append(fp8_provider(w1, w2, dtype))
        except Exception as err:  # noqa: BLE001  (the fp8 API may be incomplete)
            print(f"    fp8 setup failed: {type(err).__name__}: {err}", flush=True)
            fp8.append(Provider("tmoe", failing(err)))
    if "scaled_grouped_mm" in names:
        fp8.append(scaled_grouped_mm_provider(w1, w2))
    return fp8


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
    _, token, offs = _sort_by_expert(topk_ids, w1.shape[0])
    if x_scale is None:
        w1_t, w2_t = _transposed(w1), _transposed(w2)
        up = functools.partial(torch._grouped_mm, x[token], w1_t, offs=offs)
        h = up()
        down = functools.partial(torch._grouped_mm, F.silu(h[:, :n]) * h[:, n:], w2_t, offs=offs)
        return up, down
    scaled = dict(offs=offs, out_dtype=torch.bfloat16)
    up = functools.partial(torch._scaled_grouped_mm, x[token], w1.transpose(1, 2), x_scale.reshape(-1)[token],
                           w1_scale[..., 0], **scaled)
    h = up()
    aq, a_scale = _quantize_rows(F.silu(h[:, :n]) * h[:, n:])
    return up, functools.partial(torch._scaled_grouped_mm, aq, w2.transpose(1, 2), a_scale, w2_scale[..., 0], **scaled)
