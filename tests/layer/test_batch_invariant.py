"""Batch invariance (``tmoe.batch_invariant()``): a probe token's output row, its training forward's
row and its input-gradient row are the same bits whatever batch it sits in (its size, the probe's
position, the other tokens), on every route and scheme; dW stays bitwise reproducible.

Shapes come from one bucket per scheme (E, N, K, topk fixed; M from a few sizes), so the kernels
compile once per route and the examples only change the batch. M spans the tile rules' rows (one
slot per expert up to past 48 rows per expert, where the heuristic's tiles and block_k change) and
the chunk size (a kernel with ``chunk_size=16``)."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tmoe
from tmoe.config import ROUTES
from tmoe.kernels.route import Route

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn
E, TOPK = 4, 2
M_BUCKET = (1, 2, 3, 17, 100)  # the slots, fused, aligned routes; 100 rows: 50 per expert, past the 48-row tiles


@dataclass(frozen=True)
class Scheme:
    name: str
    dtype: torch.dtype  # the activations'
    n: int
    k: int
    quant: tmoe.FusedMoEQuantConfig | None = None


SCHEMES = {s.name: s for s in (
    Scheme("fp32", torch.float32, 64, 192),
    Scheme("bf16", torch.bfloat16, 64, 192),
    Scheme("fp8_token", torch.bfloat16, 64, 192, tmoe.FusedMoEQuantConfig(FP8, per_act_token_quant=True,
                                                                        per_out_ch_quant=True)),
    Scheme("fp8_block", torch.bfloat16, 128, 128, tmoe.FusedMoEQuantConfig(FP8, block_shape=(128, 128))),
)}


@functools.lru_cache(maxsize=None)
def weights(name: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    s = SCHEMES[name]
    g = torch.Generator().manual_seed(1)
    w1 = torch.randn(E, 2 * s.n, s.k, generator=g) / s.k**0.5
    w2 = torch.randn(E, s.k, s.n, generator=g) / s.n**0.5
    if s.quant is None:
        return w1.to(DEVICE, s.dtype), w2.to(DEVICE, s.dtype), {}
    if s.quant.block_shape is not None:
        (q1, s1), (q2, s2) = (tmoe.quantize_weight_per_block_fp8(w.to(DEVICE), s.quant.block_shape) for w in (w1, w2))
    else:
        (q1, s1), (q2, s2) = (tmoe.quantize_weight_per_channel_fp8(w.to(DEVICE)) for w in (w1, w2))
    return q1, q2, dict(w1_scale=s1, w2_scale=s2, quant_config=s.quant)


def batch(scheme: Scheme, m: int, seed: int, probes: dict[int, int]) -> tuple[torch.Tensor, ...]:
    """(x, topk_weights, topk_ids) of ``m`` random tokens, with probe token ``p`` (its own seed) at
    row ``probes[p]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, scheme.k, generator=g)
    w, ids = torch.topk(torch.randn(m, E, generator=g).softmax(-1), TOPK)
    for p, row in probes.items():
        gp = torch.Generator().manual_seed(1000 + p)
        x[row] = torch.randn(scheme.k, generator=gp)
        w[row], ids[row] = torch.topk(torch.randn(E, generator=gp).softmax(-1), TOPK)
    return x.to(DEVICE, scheme.dtype), w.to(DEVICE), ids.to(DEVICE, torch.int32)


def forced(route: str):
    return contextlib.nullcontext() if route == "auto" else tmoe.override_route(route)


def layer_rows(scheme: Scheme, route: str, x, w, ids, **kw) -> torch.Tensor:
    w1, w2, qkw = weights(scheme.name)
    with forced(route), torch.no_grad():
        return tmoe.fused_experts(x, w1, w2, w, ids, batch_invariant=True, **qkw, **kw)


@functools.lru_cache(maxsize=None)
def alone(name: str, route: str, p: int) -> torch.Tensor:
    """Probe ``p``'s output row computed on its own (M = 1)."""
    s = SCHEMES[name]
    return layer_rows(s, route, *batch(s, 1, 0, {p: 0}))[0]


def placed(d, m: int) -> dict[int, int]:
    """Probes 0 and (m > 1) 1 at distinct random rows of a batch of ``m``."""
    rows = d(st.permutations(range(m)))[:2]
    return {p: row for p, row in enumerate(rows)}


@settings(max_examples=14)
@given(st.data())
def test_forward_rows_do_not_depend_on_the_batch(data):
    """Under the mode a probe's output row equals the row it gets alone (M = 1), on every route
    (auto's changes with M) and scheme."""
    name = data.draw(st.sampled_from(sorted(SCHEMES)), label="scheme")
    route = data.draw(st.sampled_from(("auto",) + ROUTES), label="route")
    m = data.draw(st.sampled_from(M_BUCKET if route in ("auto", "sorted", "grouped") else M_BUCKET[:4]), label="m")
    s = SCHEMES[name]
    probes = placed(data.draw, m)
    out = layer_rows(s, route, *batch(s, m, data.draw(st.integers(0, 2**16), label="seed"), probes))
    for p, row in probes.items():
        assert torch.equal(out[row], alone(name, route, p)), f"probe {p} at row {row} of M={m}"


@pytest.mark.parametrize("name", ["bf16", "fp8_block"])
def test_forward_rows_across_chunks(name):
    """Chunking (``chunk_size`` 16 of M = 37: chunks of 16, 16 and 5 tokens, each its own route and
    tiles) leaves a probe's row as it is alone."""
    s = SCHEMES[name]
    w1, w2, qkw = weights(name)
    qkw = dict(qkw)
    quant = qkw.pop("quant_config", None)
    layer = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(quant), chunk_size=16,
                                       batch_invariant=True)
    probes = {0: 3, 1: 35}
    x, w, ids = batch(s, 37, 5, probes)
    with torch.no_grad():
        out = layer(x, w1, w2, w, ids, **qkw)
    for p, row in probes.items():
        assert torch.equal(out[row], alone(name, "auto", p))


def grad_rows(scheme: Scheme, m: int, probes: dict[int, int], save_preactivation: bool):
    """(out, dX, dW1, dW2) of a training call, grad_out's probe rows fixed by the probe."""
    w1, w2, _ = weights(scheme.name)
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    x, w, ids = batch(scheme, m, 7 + m, probes)
    x.requires_grad_()
    go = torch.randn(m, scheme.k, generator=torch.Generator().manual_seed(m)).to(DEVICE, scheme.dtype)
    for p, row in probes.items():
        go[row] = torch.randn(scheme.k, generator=torch.Generator().manual_seed(2000 + p)).to(DEVICE, scheme.dtype)
    out = tmoe.fused_experts(x, w1, w2, w, ids, batch_invariant=True, save_preactivation=save_preactivation)
    out.backward(go)
    return out.detach(), x.grad, w1.grad, w2.grad


@pytest.mark.parametrize("name, save_preactivation", [("fp32", True), ("bf16", False)],
                         ids=["fp32-saved", "bf16-recomputed"])
def test_training_rows_do_not_depend_on_the_batch(name, save_preactivation):
    """The training forward (saved or recomputed pre-activation) gives the inference row, and the
    probe's dX row is the same alone and at M = 100 (50 rows per expert), wherever it sits; dW of
    one batch is the same bits when computed again."""
    s = SCHEMES[name]
    out1, dx1, _, _ = grad_rows(s, 1, {0: 0}, save_preactivation)
    assert torch.equal(out1[0], alone(name, "auto", 0))
    out, dx, dw1, dw2 = grad_rows(s, 100, {0: 63}, save_preactivation)
    assert torch.equal(out[63], out1[0]), "forward row"
    assert torch.equal(dx[63], dx1[0]), "dX row"
    _, _, dw1_again, dw2_again = grad_rows(s, 100, {0: 63}, save_preactivation)
    assert torch.equal(dw1, dw1_again) and torch.equal(dw2, dw2_again)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_router_rows_do_not_depend_on_the_batch(scoring):
    """``topk_route`` works row by row in tiles sized by E alone: a row's weights and ids are the
    same at any M and position."""
    g = torch.Generator().manual_seed(3)
    probe = torch.randn(1, 64, generator=g).to(DEVICE)
    alone_w, alone_i = tmoe.topk_route(probe, 4, scoring=scoring, num_expert_group=8, topk_group=2)
    for m, row in ((5, 2), (300, 211)):
        logits = torch.randn(m, 64, generator=g).to(DEVICE)
        logits[row] = probe[0]
        w, i = tmoe.topk_route(logits, 4, scoring=scoring, num_expert_group=8, topk_group=2)
        assert torch.equal(w[row], alone_w[0]) and torch.equal(i[row], alone_i[0])


def test_dynamic_per_tensor_fp8_is_refused():
    """A dynamic per-tensor scale comes from the whole batch: refused under the mode, naming the
    argument; static scales run."""
    s = SCHEMES["bf16"]
    (q1, s1), (q2, s2) = (tmoe.quantize_weight_per_tensor_fp8(w.float()) for w in weights("bf16")[:2])
    qc = tmoe.FusedMoEQuantConfig(FP8)
    x, w, ids = batch(s, 3, 0, {})
    kw = dict(quant_config=qc, w1_scale=s1, w2_scale=s2)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="a1_scale"):
        tmoe.fused_experts(x, q1, q2, w, ids, batch_invariant=True, **kw)
    with pytest.raises(ValueError, match="a2_scale"), tmoe.batch_invariant():
        tmoe.fused_experts(x, q1, q2, w, ids, a1_scale=one, **kw)
    tmoe.fused_experts(x, q1, q2, w, ids, batch_invariant=True, a1_scale=one, a2_scale=one, **kw)
    tmoe.fused_experts(x, q1, q2, w, ids, **kw)  # outside the mode, dynamic scales run


def test_mode_is_decided_once_per_call(monkeypatch):
    """The argument wins over the context, the context over ``TMOE_BATCH_INVARIANT``; the mode
    travels in the kernel's spec by value and a bad value is named."""
    from tmoe.config import batch_invariant_requested

    monkeypatch.delenv("TMOE_BATCH_INVARIANT", raising=False)
    assert not batch_invariant_requested()
    monkeypatch.setenv("TMOE_BATCH_INVARIANT", "1")
    assert batch_invariant_requested()
    with tmoe.batch_invariant(False):
        assert not batch_invariant_requested()
        with tmoe.batch_invariant():
            assert batch_invariant_requested()
    monkeypatch.setenv("TMOE_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="TMOE_BATCH_INVARIANT"):
        batch_invariant_requested()
    monkeypatch.delenv("TMOE_BATCH_INVARIANT")
    parts = (tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts())
    on, default = (tmoe.FusedMoEModularKernel(*parts, batch_invariant=b) for b in (True, None))
    assert on.spec != default.spec and on.spec.batch_invariant is True and on.spec.op_args[-1] is True
    with pytest.raises(TypeError, match="batch_invariant"):
        tmoe.FusedMoEModularKernel(*parts, batch_invariant=1)
    with pytest.raises(TypeError, match="batch_invariant"):
        tmoe.fused_experts(*batch(SCHEMES["fp32"], 1, 0, {})[:1], *weights("fp32")[:2],
                           *batch(SCHEMES["fp32"], 1, 0, {})[1:], batch_invariant="yes")
    with pytest.raises(ValueError, match="kernel"):
        tmoe.FusedMoE(4, 64, 64, 2, kernel=on, batch_invariant=True)
    assert tmoe.FusedMoE(4, 64, 64, 2, batch_invariant=True, device=DEVICE).kernel.spec.batch_invariant is True


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_forward_rows_large_m_gpu(name):
    """On the GPU, M up to 4096 (the grouped core's sizes, tuned tables' rows), eager and as a
    CUDA-graph replay: a probe's row is its row alone."""
    s = SCHEMES[name]
    w1, w2, qkw = weights(name)
    for m in (1, 4, 64, 256, 1024, 4096):
        probes = {0: m // 3, 1: m - 1} if m > 1 else {0: 0}
        x, w, ids = batch(s, m, m, probes)
        with torch.no_grad():
            out = tmoe.fused_experts(x, w1, w2, w, ids, batch_invariant=True, **qkw)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = tmoe.fused_experts(x, w1, w2, w, ids, batch_invariant=True, **qkw)
            graph.replay()
        for p, row in probes.items():
            assert torch.equal(out[row], alone(name, "auto", p)), f"probe {p} at M={m}"
            assert torch.equal(replayed[row], out[row])


def test_fp8_tiles_are_one_height_in_the_mode(monkeypatch):
    """Under the mode, fp8 GEMMs run 64-row tiles at every M and the slot route (16-row tiles) is
    not taken (on an H100, fp8 rows of 16-row tiles differed from those of 64-row ones); outside the
    mode, decode sizes keep the slot route."""
    from tmoe.config import get_config
    from tmoe.modular.experts import TritonExperts
    from tmoe.runtime.state import clear_launch_caches

    for m in (1, 64, 256, 4096):
        cfg = get_config(m, 4, 192, 256, 2, torch.device(DEVICE), quant="fp8_w8a8", batch_invariant=True)
        assert cfg.up.block_m == cfg.down.block_m == 64, m
    clear_launch_caches()  # calls of this signature earlier in the process would replay without choosing a route
    routes = []
    apply = TritonExperts.apply
    monkeypatch.setattr(TritonExperts, "apply", lambda self, out, call, *ws: routes.append(call.route) or apply(
        self, out, call, *ws))
    s = SCHEMES["fp8_token"]
    w1, w2, qkw = weights("fp8_token")
    x, w, ids = batch(s, 1, 0, {})
    for mode in (True, False):
        tmoe.fused_experts(x, w1, w2, w, ids, batch_invariant=mode, **qkw)
    assert routes == [Route.SORTED, Route.SLOTS]
