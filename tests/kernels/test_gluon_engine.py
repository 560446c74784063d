"""The warp-specialized Gluon engine on a Hopper GPU: the dense matmul against the float32 product,
the grouped expert GEMMs (through the whole layer on the grouped route) against the ``tl`` core and
the float32 reference, for every activation, the router weight on either GEMM, skewed and empty
experts, M = 1 and tails of the valid tile count, with poisoned outputs. CPU CI compiles the same
kernels for sm_90 (``tests/contracts/test_gluon_compile.py``)."""
import pytest
import torch

import tmoe
from tmoe.config import override_config
from tmoe.kernels.activation import ACTIVATIONS
from tmoe.kernels.gemm_config import GemmConfig
from tmoe.reference import moe_reference
from tmoe.runtime.gluon import gluon_ready, override_engine
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

with override_engine("gluon"):
    HOPPER = torch.cuda.is_available() and gluon_ready(torch.device("cuda"), "down", 1)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (the Gluon engine)")]


@pytest.fixture
def gluon_calls(monkeypatch):
    """The Gluon grouped launches made so far (the test fails if the engine was not used)."""
    from tmoe.kernels import gluon_grouped
    calls = []
    run = gluon_grouped.invoke_gluon_grouped_gemm
    monkeypatch.setattr(gluon_grouped, "invoke_gluon_grouped_gemm", lambda *a, **kw: (calls.append(1), run(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("m, n, k", [(1, 128, 64), (129, 256, 1000), (1000, 384, 4096), (4096, 4096, 4096)])
@pytest.mark.parametrize("cfg", [GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
                                 GemmConfig(128, 128, 64, num_warps=4, num_stages=4)], ids=str)
def test_dense_matches_float32(m, n, k, cfg):
    from tmoe.kernels.gluon_matmul import gluon_dense_matmul
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gluon_dense_matmul(a, b, cfg, torch.cuda.get_device_properties(0).multi_processor_count, out=out)
    assert_close(out, a.float() @ b.float().T, torch.bfloat16)


UP, DOWN = GemmConfig(128, 128, 64, num_warps=8, tma=True, persistent=True), GemmConfig(
    128, 256, 64, num_warps=8, tma=True, persistent=True)


@pytest.mark.parametrize("shape, routing", [
    (MoEShape(1, 8, 256, 512, 2), "uniform"),  # M = 1: one padded row block per expert used
    (MoEShape(300, 8, 256, 512, 2), "skewed"),
    (MoEShape(517, 16, 512, 1024, 4), "empty_experts"),
    (MoEShape(2048, 8, 1024, 2048, 2), "one_hot"),  # every token on one expert: a long run of tiles
], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_layer_matches_tl_and_reference(shape, routing, dtype, gluon_calls):
    p = make_problem(shape, dtype, routing, seed=shape.m + 3, device="cuda")
    args = (p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    with tmoe.override_route("grouped"), override_config(tmoe.MoEConfig(UP, DOWN)):
        with override_engine("gluon"):
            out = tmoe.fused_experts(*args)
        assert len(gluon_calls) == 2
        with override_engine("tl"):
            tl_out = tmoe.fused_experts(*args)
    assert len(gluon_calls) == 2
    assert_close(out, moe_reference(*args), dtype)
    assert_close(out, tl_out, dtype, name="gluon against tl")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("on_input", [False, True])
def test_grouped_activations_and_router_weight(activation, on_input, gluon_calls):
    topk = 1 if on_input else 2
    p = make_problem(MoEShape(333, 8, 256, 512, topk), torch.bfloat16, "skewed", seed=11, device="cuda")
    w1 = p.w1 if not activation.endswith("no_mul") else p.w1[:, :256].contiguous()
    kw = dict(activation=activation, apply_router_weight_on_input=on_input)
    with tmoe.override_route("grouped"), override_config(tmoe.MoEConfig(UP, DOWN)), override_engine("gluon"):
        out = tmoe.fused_experts(p.x, w1, p.w2, p.topk_weights, p.topk_ids, **kw)
    assert len(gluon_calls) == 2
    assert_close(out, moe_reference(p.x, w1, p.w2, p.topk_weights, p.topk_ids, **kw), torch.bfloat16)


def test_grouped_graph_replay_with_new_routing(gluon_calls):
    """Captured once, replayed after new routing is copied into the same buffers: the engine reads
    the valid tile count and the experts from device memory."""
    from tmoe.testing import capture_cuda_graph
    p = make_problem(MoEShape(512, 8, 256, 512, 2), torch.bfloat16, "uniform", seed=1, device="cuda")
    q = make_problem(MoEShape(512, 8, 256, 512, 2), torch.bfloat16, "skewed", seed=2, device="cuda")
    with tmoe.override_route("grouped"), override_config(tmoe.MoEConfig(UP, DOWN)), override_engine("gluon"):
        fn = lambda: tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)  # noqa: E731
        graph, out = capture_cuda_graph(fn)
        p.topk_ids.copy_(q.topk_ids)
        p.topk_weights.copy_(q.topk_weights)
        graph.replay()
    assert gluon_calls
    assert_close(out, moe_reference(p.x, p.w1, p.w2, q.topk_weights, q.topk_ids), torch.bfloat16)


FP8_UP, FP8_DOWN = (GemmConfig(128, n, 128, num_warps=8, tma=True, persistent=True) for n in (128, 256))


@pytest.mark.parametrize("scheme", ["tensor", "tensor_static", "token"])
def test_grouped_fp8_scaled(scheme, gluon_calls):
    """fp8 activations with per-tensor (dynamic, static) or per-token scales and per-tensor or
    per-channel weight scales: the engine rescales in its epilogue, as the tl core does."""
    from tests.layer.test_fp8_layer import SCHEMES, run_scheme
    p = make_problem(MoEShape(700, 8, 256, 512, 2), torch.bfloat16, "skewed", seed=7, device="cuda")
    chosen = next(s for s in SCHEMES if s.name == scheme)
    with tmoe.override_route("grouped"), override_config(tmoe.MoEConfig(FP8_UP, FP8_DOWN)):
        with override_engine("gluon"):
            out, ref = run_scheme(p, chosen)
        assert len(gluon_calls) == 2
        with override_engine("tl"):
            tl_out, _ = run_scheme(p, chosen)
    assert_close(out, ref, "fp8")
    assert_close(out, tl_out, "fp8", name="gluon against tl")


def test_grouped_biases(gluon_calls):
    p = make_problem(MoEShape(300, 8, 256, 512, 2), torch.bfloat16, "skewed", seed=9, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(10)
    kw = dict(w1_bias=torch.randn(p.w1.shape[:2], device="cuda", generator=g).bfloat16(),
              w2_bias=torch.randn(p.w2.shape[:2], device="cuda", generator=g).bfloat16())
    with tmoe.override_route("grouped"), override_config(tmoe.MoEConfig(UP, DOWN)), override_engine("gluon"):
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **kw)
    assert len(gluon_calls) == 2
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **kw), torch.bfloat16)


def test_training_forward_saves_preactivation_on_the_engine(gluon_calls):
    """The training forward (the up GEMM also stores the pre-activation the backward reads) on the
    engine: the gradients match float64 autograd of the reference."""
    p = make_problem(MoEShape(400, 8, 256, 512, 2), torch.bfloat16, "skewed", seed=12, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (p.x, p.w1, p.w2, p.topk_weights)]
    with tmoe.override_route("grouped"), override_config(tmoe.MoEConfig(UP, DOWN)), override_engine("gluon"):
        out = tmoe.fused_experts(*leaves, p.topk_ids)
        grad = torch.randn_like(out)
        out.backward(grad)
    assert gluon_calls
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = moe_reference(*ref_leaves, p.topk_ids)
    ref.backward(grad.double())
    assert_close(out, ref, torch.bfloat16)
    for name, t, r in zip(("x", "w1", "w2", "topk_weights"), leaves, ref_leaves):
        assert_close(t.grad, r.grad, torch.bfloat16, name=f"d{name}")


@pytest.mark.parametrize("m", [400, 2048])
def test_input_gradient_on_the_engine(m, monkeypatch):
    """The input gradient's M-grouped GEMM (``gluon_grad_input``) against the tl kernel and float64
    autograd of the reference: dx, and the router weights' gradient it sums in the same pass."""
    from tmoe.kernels import gluon_grad_input
    calls = []
    run = gluon_grad_input.invoke_gluon_grad_input
    monkeypatch.setattr(gluon_grad_input, "invoke_gluon_grad_input", lambda *a, **kw: (calls.append(1), run(*a, **kw))[1])
    p = make_problem(MoEShape(m, 8, 256, 512, 2), torch.bfloat16, "skewed", seed=m, device="cuda")
    grad = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for engine in ("gluon", "tl"):
        leaves = [t.detach().clone().requires_grad_() for t in (p.x, p.w1, p.w2, p.topk_weights)]
        with override_engine(engine):
            tmoe.fused_experts(*leaves, p.topk_ids).backward(grad)
        grads[engine] = [t.grad for t in leaves]
    assert calls
    ref_leaves = [t.detach().double().requires_grad_() for t in (p.x, p.w1, p.w2, p.topk_weights)]
    moe_reference(*ref_leaves, p.topk_ids).backward(grad.double())
    for i, name in enumerate(("x", "w1", "w2", "topk_weights")):
        assert_close(grads["gluon"][i], ref_leaves[i].grad, torch.bfloat16, name=f"d{name}")
        assert_close(grads["gluon"][i], grads["tl"][i], torch.bfloat16, name=f"d{name} gluon against tl")
