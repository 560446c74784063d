"""The grouped-GEMM core (``moe_grouped_gemm``: expert-sorted rows from ``sorted_rows``, both
operands by TMA, persistent programs; four under the interpreter) against the float32 reference:
the whole layer on the "grouped" route (tails, skew, empty experts, M = 0 and 1, fp8 schemes,
biases, activations, router weight on the input), the kernels alone with poisoned outputs, the
operands it cannot read falling back to the pointer route, and the route's token threshold."""
import pytest
import torch

import tmoe
import tmoe.modular.experts as experts_module
from tmoe.config import GROUPED_MIN_N, GROUPED_MIN_ROWS_PER_EXPERT, grouped_config, override_config
from tmoe.config import use_grouped_route
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.moe_grouped_gemm import grouped_operands_fit, invoke_grouped_gemm
from tmoe.kernels.operands import Routing
from tmoe.kernels.sorted_rows import sorted_rows
from tmoe.reference import act_and_mul_reference, moe_reference
from tmoe.runtime.state import clear_launch_caches
from tmoe.testing import assert_close, capture_cuda_graph
from tmoe.testing.strategies import MoEShape, half_remote_swigluoai, make_problem
from tests.kernels.test_moe_gemm_persistent import persistent_config
from tests.layer.test_fp8_layer import SCHEMES, run_scheme

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def grouped_calls(monkeypatch):
    """The number of grouped-core launches made so far (the test fails if the route fell back unseen)."""
    calls = []
    launch = experts_module.invoke_grouped_gemm
    monkeypatch.setattr(experts_module, "invoke_grouped_gemm", lambda *a, **kw: (calls.append(1), launch(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, routing, cfg", [
    (MoEShape(40, 8, 64, 64, 2), "skewed", (16, 32, 32, 32)),  # more tiles than programs
    (MoEShape(33, 8, 96, 80, 2), "empty_experts", (16, 64, 32, 32, 3)),  # N, K tails; partial tile groups
    (MoEShape(1, 4, 64, 64, 2), "uniform", (32, 32, 64, 32)),  # M=1: padding rows, fewer tiles than programs
    (MoEShape(0, 4, 64, 64, 2), "uniform", (16, 32, 32, 32)),  # M=0
    (MoEShape(45, 4, 64, 128, 3), "out_of_range", (16, 32, 64, 64)),  # ids outside [0, E) add zero
], ids=str)
def test_grouped_layer_matches_reference(shape, routing, cfg, dtype, grouped_calls):
    p = make_problem(shape, dtype, routing, seed=shape.m + 1, device=DEVICE)
    with tmoe.override_route("grouped"), override_config(persistent_config(*cfg)):
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), dtype)
    assert len(grouped_calls) == (2 if shape.m else 0)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_grouped_fp8(scheme, grouped_calls):
    """Per-tensor (dynamic, static), per-token/per-channel and 128 x 128 block scales; the
    activation scales are sorted with the rows, block scales' intermediate quantized in the epilogue."""
    p = make_problem(MoEShape(37, 4, 256, 256, 2), torch.bfloat16, "skewed", seed=37, device=DEVICE)
    with tmoe.override_route("grouped"), override_config(persistent_config(16, 128, 128, 128)):
        out, ref = run_scheme(p, scheme)
    assert_close(out, ref, "fp8")
    assert len(grouped_calls) == 2


@pytest.mark.parametrize("activation", ["swigluoai", "gelu", "silu_no_mul"])
def test_grouped_biases_activations_and_input_weights(activation, grouped_calls):
    """Biases of both GEMMs, gated and non-gated activations, the router weight applied to the
    input by the up GEMM (top-1, as vLLM requires)."""
    p = make_problem(MoEShape(29, 8, 64, 64, 1), torch.bfloat16, "uniform", seed=5, device=DEVICE)
    g = torch.Generator().manual_seed(6)
    w1 = p.w1 if not activation.endswith("no_mul") else p.w1[:, :64].contiguous()
    b1 = torch.randn(w1.shape[:2], generator=g).to(DEVICE, torch.bfloat16)
    b2 = torch.randn(p.w2.shape[:2], generator=g).to(DEVICE, torch.bfloat16)
    kw = dict(activation=activation, w1_bias=b1, w2_bias=b2, apply_router_weight_on_input=True)
    with tmoe.override_route("grouped"), override_config(persistent_config(16, 32, 32, 32)):
        out = tmoe.fused_experts(p.x, w1, p.w2, p.topk_weights, p.topk_ids, **kw)
    assert_close(out, moe_reference(p.x, w1, p.w2, p.topk_weights, p.topk_ids, **kw), torch.bfloat16)
    assert len(grouped_calls) == 2


def test_grouped_kernels_write_exactly_their_rows():
    """Poisoned outputs: the up GEMM writes every sorted row of a real slot (and leaves padding rows
    and rows past the real count alone), the down GEMM every routed slot's row."""
    m, e, n, k, topk, bm = 21, 4, 64, 96, 2, 16
    p = make_problem(MoEShape(m, e, n, k, topk), torch.float32, "skewed", seed=11, device=DEVICE)
    cfg = persistent_config(bm, 32, 32, 32)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(p.topk_ids, bm, e)
    up_rows = Routing(sorted_ids, expert_ids, num_post_padded, m * topk, topk)
    em = sorted_ids.shape[0]
    x_sorted = torch.full((em, k), float("nan"), device=DEVICE)
    sorted_rows(p.x, up_rows, x_sorted)
    rows = int(num_post_padded[0])
    slots = sorted_ids[:rows].long()
    real = slots < m * topk
    assert torch.equal(x_sorted[:rows][real], p.x[slots[real] // topk]) and not x_sorted[:rows][~real].any()
    inter = torch.full((em, n), float("nan"), device=DEVICE)
    invoke_grouped_gemm(x_sorted, p.w1, inter, cfg.up, up_rows, gated=True)
    h = torch.einsum("rk,rnk->rn", p.x[slots[real] // topk].double(), p.w1[expert_ids.long().repeat_interleave(bm)[:rows][real]].double())
    assert_close(inter[:rows][real], act_and_mul_reference(h[:, :n], h[:, n:], "silu"), torch.float32)
    assert inter[:rows][~real].isnan().all() and inter[rows:].isnan().all()
    out = torch.full((m * topk, k), float("nan"), device=DEVICE)
    invoke_grouped_gemm(inter, p.w2, out, cfg.down, Routing(sorted_ids, expert_ids, num_post_padded, m * topk, 1),
                        gated=False)
    y = torch.einsum("rn,rkn->rk", inter[:rows][real].double(),
                     p.w2[expert_ids.long().repeat_interleave(bm)[:rows][real]].double())
    assert_close(out[slots[real]], y, torch.float32)
    assert not out.isnan().any()  # every slot is routed to a local expert


def test_grouped_falls_back_where_operands_do_not_fit(grouped_calls):
    """An expert map (remote slots), interleaved gate/up rows and weights stored transposed take the
    pointer route, with the same results."""
    p = make_problem(MoEShape(29, 8, 64, 64, 2), torch.bfloat16, "uniform", seed=9, device=DEVICE)
    w1, w2, kwargs = half_remote_swigluoai(p, DEVICE)
    w1t = p.w1.transpose(1, 2).contiguous().transpose(1, 2)
    assert not grouped_operands_fit(w1t) and not grouped_operands_fit(p.w1, interleaved=True)
    cases = [(w1, w2, kwargs), (p.w1, p.w2, dict(activation="swigluoai", gate_up_interleaved=True)), (w1t, p.w2, {})]
    for a, b, kw in cases:
        with tmoe.override_route("grouped"), override_config(persistent_config(16, 32, 32, 32)):
            out = tmoe.fused_experts(p.x, a, b, p.topk_weights, p.topk_ids, **kw)
        assert_close(out, moe_reference(p.x, a, b, p.topk_weights, p.topk_ids, **kw), torch.bfloat16)
    assert grouped_calls == []


def test_grouped_route_threshold_and_persistent_config():
    """The default route takes the grouped core from GROUPED_MIN_ROWS_PER_EXPERT routed rows per
    local expert and intermediate size GROUPED_MIN_N, except for fp8 block scales; its tiles are
    persistent and TMA, block_k 64 (fp8: 128, block scales: the group)."""
    e, topk, n = 8, 2, GROUPED_MIN_N
    m = GROUPED_MIN_ROWS_PER_EXPERT * e // topk
    assert use_grouped_route(m, topk, e, n, False)
    assert not use_grouped_route(m - 1, topk, e, n, False)
    assert not use_grouped_route(m, topk, e, n // 2, False) and not use_grouped_route(m, topk, e, n, True)
    with tmoe.override_route("sorted"):
        assert not use_grouped_route(m, topk, e, n, False)
    with tmoe.override_route("grouped"):
        assert use_grouped_route(1, topk, e, 64, True)
    cfg = grouped_config()
    assert cfg.block_m == 128 and cfg.up.block_k == 64 and all(c.tma and c.persistent for c in (cfg.up, cfg.down))
    assert grouped_config(fp8=True).up.block_k == 128 and grouped_config((128, 64), fp8=True).down.block_k == 64
    with override_config(persistent_config(16, 32, 64, 32)):
        assert grouped_config() == persistent_config(16, 32, 64, 32)


@pytest.mark.parametrize("scheme", [None, *[s for s in SCHEMES if s.name in ("token", "block")]],
                         ids=lambda s: "bf16" if s is None else s.name)
def test_default_route_at_the_threshold(scheme, grouped_calls):
    """Unforced, a call at the thresholds (lowered to 16 rows per expert and N = 128 here, so the
    interpreter runs it quickly) runs on the grouped core in bf16 and fp8 per-token, on the aligned
    route with fp8 block scales, and on the aligned route once N is below the threshold; each
    matches its reference. Launch plans are kept per call signature, so they are cleared whenever
    the thresholds change (as ``tmoe.config`` says)."""
    e, topk = 4, 2
    p = make_problem(MoEShape(16 * e // topk, e, 128, 128, topk), torch.bfloat16, "uniform", seed=12, device=DEVICE)
    try:
        with pytest.MonkeyPatch.context() as lowered:
            lowered.setattr(tmoe.config, "GROUPED_MIN_ROWS_PER_EXPERT", 16)
            lowered.setattr(tmoe.config, "GROUPED_MIN_N", 128)
            clear_launch_caches()
            if scheme is None:
                out, tol = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), torch.bfloat16
                ref = moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
            else:
                (out, ref), tol = run_scheme(p, scheme), "fp8"
            assert_close(out, ref, tol)
            assert len(grouped_calls) == (0 if scheme is not None and scheme.name == "block" else 2)
            lowered.setattr(tmoe.config, "GROUPED_MIN_N", 256)
            clear_launch_caches()
            grouped_calls.clear()
            out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
            assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), torch.bfloat16)
            assert grouped_calls == []
    finally:
        clear_launch_caches()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and compile on the GPU")
def test_grouped_default_route_compiles_and_replays(grouped_calls):
    """At a size the default route sends to the grouped core: eager, torch.compile(fullgraph=True)
    and a CUDA-graph replay on new inputs all match the reference."""
    e, n, k, topk, m = 8, 1024, 512, 2, 1024
    p = make_problem(MoEShape(m, e, n, k, topk), torch.bfloat16, "uniform", seed=3, device="cuda")
    args = (p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    ref = moe_reference(*args)
    assert_close(tmoe.fused_experts(*args), ref, torch.bfloat16)
    assert len(grouped_calls) == 2
    compiled = torch.compile(tmoe.fused_experts, fullgraph=True)
    assert_close(compiled(*args), ref, torch.bfloat16)
    static = [t.clone() for t in args]
    graph, out = capture_cuda_graph(lambda: tmoe.fused_experts(*static))
    q = make_problem(MoEShape(m, e, n, k, topk), torch.bfloat16, "skewed", seed=4, device="cuda")
    for dst, src in zip(static, (q.x, q.w1, q.w2, q.topk_weights, q.topk_ids)):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    assert_close(out, moe_reference(q.x, q.w1, q.w2, q.topk_weights, q.topk_ids), torch.bfloat16)


def test_grouped_calls_repeat_with_new_inputs(grouped_calls):
    """Calls of one signature with new inputs each match their reference. The whole-call replay
    (``tmoe.runtime.replay``) refuses recordings whose TMA descriptors lie on memory the call
    allocated (the sorted rows), so every call runs its launchers (host time the grouped route's
    millisecond-scale GEMMs hide; CUDA graphs skip it)."""
    shape = MoEShape(24, 4, 64, 64, 2)
    for seed in range(4):
        p = make_problem(shape, torch.bfloat16, "skewed" if seed % 2 else "uniform", seed=seed, device=DEVICE)
        with tmoe.override_route("grouped"), override_config(persistent_config(16, 32, 32, 32)):
            out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
        assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), torch.bfloat16)
    assert len(grouped_calls) == 8
