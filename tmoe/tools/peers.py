"""The whole-layer providers ``python -m tmoe bench`` times: the tmoe layer (per route), two
plain-PyTorch bf16 peers and one fp8 peer; each stage alone is in ``stage_calls.py``, the
ceilings and the timers in ``timing.py``.

Every provider maps one ``RoutedInputs`` to the (M, K) layer output. Peers follow the layout
``tmoe.fused_experts`` takes: w1 (E, 2N, K) gate rows then up rows, w2 (E, K, N), silu.
"""
from __future__ import annotations

import functools
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

import tmoe
from tmoe.tools.inputs import Provider, RoutedInputs
from tmoe.tools.low_bit import LOW_BIT_DTYPES, low_bit_providers
from tmoe.weights import quantize_weight_per_block_fp8, quantize_weight_per_channel_fp8

FP8_MODES = ("fp8_block", "fp8_token")


def sort_by_expert(topk_ids: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    order, token, offs = sort_by_expert(topk_ids, w1_t.shape[0])
    h = torch._grouped_mm(x[token], w1_t, offs=offs)  # [M*topk, 2N]
    a = F.silu(h[:, :n]) * h[:, n:]
    y = torch._grouped_mm(a, w2_t, offs=offs)  # [M*topk, K]
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    order, token, offs = sort_by_expert(topk_ids, w1q_t.shape[0])
    xq, x_scale = quantize_rows(x)  # [M, K], [M]: quantized once per token, then gathered
    xq, x_scale = xq[token], x_scale[token]  # [M*topk, K], [M*topk]
    h = torch._scaled_grouped_mm(xq, w1q_t, x_scale, s1, offs=offs, out_dtype=torch.bfloat16)  # [M*topk, 2N]
    aq, a_scale = quantize_rows(F.silu(h[:, :n]) * h[:, n:])  # [M*topk, N], [M*topk]
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
def grouped_mm_takes_views(device: torch.device) -> bool:
    """Whether ``_grouped_mm`` accepts a transposed (column-major) view of a contiguous weight."""
    a = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    w = torch.randn(2, 64, 64, dtype=torch.bfloat16, device=device)
    try:
        torch._grouped_mm(a, w.transpose(1, 2), offs=torch.tensor([8, 16], dtype=torch.int32, device=device))
        return True
    except RuntimeError:
        return False


def transposed(w: torch.Tensor) -> torch.Tensor:
    """(E, A, B) -> (E, B, A): a view when ``_grouped_mm`` takes one, else a contiguous copy (made once)."""
    t = w.transpose(1, 2)
    return t if grouped_mm_takes_views(w.device) else t.contiguous()


def bf16_providers(w1: torch.Tensor, w2: torch.Tensor, names: tuple[str, ...]) -> list[Provider]:
    """The bf16 providers among "tmoe", "grouped_mm", "loop", in that order."""
    providers = []
    if "tmoe" in names:
        providers.append(Provider("tmoe", lambda r: tmoe.fused_experts(r.x, w1, w2, r.topk_weights, r.topk_ids)))
    if "grouped_mm" in names:
        try:
            w1_t, w2_t = transposed(w1), transposed(w2)
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


def _within(fn: Callable[[RoutedInputs], torch.Tensor], context: Callable[[], ContextManager]
            ) -> Callable[[RoutedInputs], torch.Tensor]:
    """``fn`` called inside a fresh ``context()`` each time (a forced route, the batch-invariant mode)."""
    def call(r: RoutedInputs) -> torch.Tensor:
        with context():
            return fn(r)
    return call


def with_routes(providers: list[Provider], routes: tuple[str, ...]) -> list[Provider]:
    """The "tmoe" provider once per route: "auto" as it is, "sorted"/"direct" forced to the
    aligned or decode path and named "tmoe[sorted]"/"tmoe[direct]"; other providers unchanged."""
    out = []
    for p in providers:
        if p.name != "tmoe":
            out.append(p)
            continue
        out += [p if r == "auto" else Provider(f"tmoe[{r}]", _within(p.fn, functools.partial(tmoe.override_route, r)),
                                               p.syncs) for r in routes]
    return out


def batch_invariant(providers: list[Provider]) -> list[Provider]:
    """Every tmoe provider run under ``tmoe.batch_invariant()``, named "<name>[invariant]"; the
    peers unchanged."""
    return [Provider(f"{p.name}[invariant]", _within(p.fn, tmoe.batch_invariant), p.syncs)
            if p.name.startswith("tmoe") else p for p in providers]


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
