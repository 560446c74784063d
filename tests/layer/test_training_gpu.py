"""GPU training tests (marked ``gpu``; skipped on CPU): the layer's gradients against a float64
autograd reference, bitwise-reproducible gradients, a whole training step captured in a CUDA graph
and replayed with new routing, no host syncs through backward, a compiled training step, the
Qwen3-30B-A3B layer, and the router's gradient through ``FusedMoE``."""
import pytest
import torch

import tmoe
from tmoe.reference import moe_reference, topk_route_reference
from tmoe.testing import rel_error

pytestmark = pytest.mark.gpu

E, N, K, TOPK = 8, 128, 256, 2
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
NAMES = ("x", "w1", "w2", "topk_weights", "w1_bias", "w2_bias")
ACTS = {  # name -> fused_experts options (the reference takes the same ones)
    "silu": dict(activation="silu"),
    "swigluoai_interleaved_bias": dict(activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=7.0,
                                       gate_up_interleaved=True),
}


def _problem(m, dtype, biases, e=E, n=N, k=K, topk=TOPK):
    """Leaves x, w1, w2, topk_weights (float32), optional w1_bias, w2_bias, all requiring grad; ids; grad_out."""
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=dtype) / k**0.5
    w2 = torch.randn(e, k, n, device="cuda", dtype=dtype) / n**0.5
    weights, ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
    leaves = [x, w1, w2, weights.contiguous()]
    if biases:
        leaves += [torch.randn(e, 2 * n, device="cuda", dtype=dtype) * 0.1,
                   torch.randn(e, k, device="cuda", dtype=dtype) * 0.1]
    leaves = [t.requires_grad_() for t in leaves]
    grad_out = torch.randn(m, k, device="cuda", dtype=dtype)
    return leaves, ids.to(torch.int32).contiguous(), grad_out


def _bias_kwargs(leaves):
    return dict(w1_bias=leaves[4], w2_bias=leaves[5]) if len(leaves) == 6 else {}


def _tmoe_grads(leaves, ids, grad_out, **opts):
    x, w1, w2, tw = leaves[:4]
    out = tmoe.fused_experts(x, w1, w2, tw, ids, **opts, **_bias_kwargs(leaves))
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))


def _reference_grads(leaves, ids, grad_out, dtype=torch.float64, **opts):
    """moe_reference in ``dtype`` with autograd, on upcast copies of the leaves."""
    ref = [t.detach().to(dtype).requires_grad_() for t in leaves]
    x, w1, w2, tw = ref[:4]
    out = moe_reference(x, w1, w2, tw, ids, dtype=dtype, **opts, **_bias_kwargs(ref))
    return (out.detach(), *torch.autograd.grad(out, ref, grad_out.to(dtype)))


def _check(got, want, tol, label):
    errs = {name: rel_error(g.float(), w) for name, g, w in zip(("out",) + NAMES, got, want)}
    worst = max(errs, key=errs.get)
    print(f"{label}: worst {worst} {errs[worst]:.2e}; " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    for name, g, w in zip(("out",) + NAMES, got, want):
        assert g.shape == w.shape, (label, name)
        assert torch.isfinite(g).all(), (label, name)
    assert errs[worst] <= tol, (label, errs)


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 37, 256])
def test_gradients_vs_float64(m, dtype, act):
    opts = ACTS[act]
    leaves, ids, grad_out = _problem(m, dtype, biases=act != "silu")
    got = _tmoe_grads(leaves, ids, grad_out, **opts)
    assert got[4].dtype == torch.float32  # topk_weights' gradient in its own dtype
    assert all(g.dtype == dtype for i, g in enumerate(got) if i != 4)
    _check(got, _reference_grads(leaves, ids, grad_out, **opts), TOL[dtype], f"{act} {dtype} M={m}")


@pytest.mark.parametrize("act", list(ACTS))
def test_gradients_bitwise_reproducible(act):
    leaves, ids, grad_out = _problem(256, torch.bfloat16, biases=act != "silu")
    first = _tmoe_grads(leaves, ids, grad_out, **ACTS[act])
    second = _tmoe_grads(leaves, ids, grad_out, **ACTS[act])
    for name, a, b in zip(("out",) + NAMES, first, second):
        assert torch.equal(a, b), name


def _params(w1_0, w2_0):
    return [torch.nn.Parameter(w1_0.clone()), torch.nn.Parameter(w2_0.clone())]


def test_training_step_in_cuda_graph_replays_new_routing():
    m, dtype, lr = 64, torch.bfloat16, 0.5
    w1_0 = torch.randn(E, 2 * N, K, device="cuda", dtype=dtype) / K**0.5
    w2_0 = torch.randn(E, K, N, device="cuda", dtype=dtype) / N**0.5
    static_x = torch.randn(m, K, device="cuda", dtype=dtype)
    static_w = torch.zeros(m, TOPK, device="cuda")
    static_ids = torch.zeros(m, TOPK, device="cuda", dtype=torch.int32)
    static_g = torch.randn(m, K, device="cuda", dtype=dtype)

    def route(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        w, i = torch.topk(torch.randn(m, E, device="cuda", generator=gen).softmax(-1), TOPK)
        x = torch.randn(m, K, device="cuda", dtype=dtype, generator=gen)
        return x, w.contiguous(), i.to(torch.int32).contiguous()

    def load(seed):
        x, w, i = route(seed)
        with torch.no_grad():  # static_x is a leaf that requires grad after the first step
            static_x.copy_(x), static_w.copy_(w), static_ids.copy_(i)

    params = _params(w1_0, w2_0)
    opt = torch.optim.SGD(params, lr=lr)

    def step():
        out = tmoe.fused_experts(static_x.requires_grad_(), params[0], params[1], static_w, static_ids)
        out.backward(static_g)
        opt.step()

    load(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: every kernel compiles here, not during capture
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            static_x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    static_x.grad = None
    with torch.cuda.graph(graph):
        step()

    for seed in (2, 3):  # new routing and inputs copied into the static buffers, params reset
        with torch.no_grad():
            params[0].copy_(w1_0), params[1].copy_(w2_0)
        load(seed)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [p.detach().clone() for p in params]
        dx_replayed = static_x.grad.clone()

        eager = _params(w1_0, w2_0)
        x, w, i = route(seed)
        x.requires_grad_()
        out = tmoe.fused_experts(x, eager[0], eager[1], w, i)
        out.backward(static_g)
        torch.optim.SGD(eager, lr=lr).step()
        for name, a, b in (("w1", replayed[0], eager[0]), ("w2", replayed[1], eager[1]), ("dx", dx_replayed, x.grad)):
            exact = torch.equal(a, b.detach())
            err = rel_error(a.float(), b.detach().float())
            print(f"seed {seed} {name}: replay == eager exactly: {exact}, rel err {err:.1e}")
            assert err <= 1e-3, (seed, name, err)
        assert not torch.equal(replayed[0], w1_0), "the replayed step changed nothing"


def test_no_host_sync_through_backward():
    leaves, ids, grad_out = _problem(256, torch.bfloat16, biases=True)
    opts = ACTS["swigluoai_interleaved_bias"]
    _tmoe_grads(leaves, ids, grad_out, **opts)  # warm-up (compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = _tmoe_grads(leaves, ids, grad_out, **opts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(g).all() for g in grads)


def test_compiled_training_step_equals_eager():
    torch._dynamo.reset()

    def layer(x, w1, w2, tw, ids):
        return tmoe.fused_experts(x, w1, w2, tw, ids)

    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for m in (37, 64, 200):
        leaves, ids, grad_out = _problem(m, torch.bfloat16, biases=False)
        out = compiled(*leaves, ids)
        got = (out.detach(), *torch.autograd.grad(out, leaves, grad_out))
        want = _tmoe_grads(leaves, ids, grad_out)
        for name, a, b in zip(("out",) + NAMES, got, want):
            err = rel_error(a.float(), b.float())
            print(f"compiled vs eager M={m} {name}: exact {torch.equal(a, b)}, rel err {err:.1e}")
            assert err <= 1e-3, (m, name, err)


@pytest.mark.large_memory  # 14 GB (float32 reference copies of the leaves and their gradients)
def test_qwen3_layer_gradients_vs_float32():
    e, n, k, topk, m = 128, 768, 2048, 8, 512
    leaves, ids, grad_out = _problem(m, torch.bfloat16, biases=False, e=e, n=n, k=k, topk=topk)
    got = _tmoe_grads(leaves, ids, grad_out)
    want = _reference_grads(leaves, ids, grad_out, dtype=torch.float32)
    _check(got, want, 2e-2, "qwen3 M=512 bf16 vs float32")


@pytest.mark.parametrize("m", [1, 64])
def test_fused_moe_router_gradient(m):
    torch.manual_seed(1)
    layer = tmoe.FusedMoE(E, K, N, TOPK, dtype=torch.float32, device="cuda")  # experts, hidden, intermediate
    layer.requires_grad_(True)
    x = torch.randn(m, K, device="cuda", requires_grad=True)
    grad_out = torch.randn(m, K, device="cuda")
    out = layer(x)
    out.backward(grad_out)
    assert layer.router_weight.grad is not None

    f64 = torch.float64
    rw, w1, w2, x64 = (t.detach().to(f64).requires_grad_() for t in (layer.router_weight, layer.w1, layer.w2, x))
    weights, ids = topk_route_reference(x64 @ rw.T, TOPK, dtype=f64)
    _, layer_ids = tmoe.topk_route(torch.nn.functional.linear(x.detach(), layer.router_weight.detach()), TOPK)
    assert torch.equal(ids.sort(-1).values, layer_ids.sort(-1).values), "selection differs from the reference's"
    ref_out = moe_reference(x64, w1, w2, weights, ids, dtype=f64)
    ref_out.backward(grad_out.to(f64))
    for name, got, want in (("out", out.detach(), ref_out.detach()), ("router_weight", layer.router_weight.grad, rw.grad),
                            ("w1", layer.w1.grad, w1.grad), ("w2", layer.w2.grad, w2.grad), ("x", x.grad, x64.grad)):
        err = rel_error(got, want)
        print(f"FusedMoE fp32 M={m} {name}: rel err {err:.1e}")
        assert err <= 1e-3, (name, err)
