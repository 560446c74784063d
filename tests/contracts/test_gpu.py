"""GPU-only tests (marked ``gpu``; skipped on CPU): model shapes, CUDA graphs, compile with
reduce-overhead, no host syncs, int64 addressing, device checks."""
import gc

import pytest
import torch

import tmoe
from tmoe.reference import moe_reference
from tmoe.testing import assert_close, capture_cuda_graph, rel_error
from tmoe.testing.strategies import MoEShape, make_problem

pytestmark = pytest.mark.gpu
MODEL_SHAPES = {  # (E, N, K, topk)
    "mixtral": (8, 14336, 4096, 2),
    "qwen3_30b_a3b": (128, 768, 2048, 8),
    "deepseek_v3": (256, 2048, 7168, 8),
}


def _weights(e, n, k, dtype=torch.bfloat16):
    w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=dtype) / k**0.5
    w2 = torch.randn(e, k, n, device="cuda", dtype=dtype) / n**0.5
    return w1, w2


def _routing(m, e, topk):
    weights, ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
    return weights, ids.to(torch.int32)


@pytest.mark.large_memory
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_model_shapes_bf16(model):
    e, n, k, topk = MODEL_SHAPES[model]
    w1, w2 = _weights(e, n, k)
    for m in (1, 8, 64, 1024):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weights, ids = _routing(m, e, topk)
        out = tmoe.fused_experts(x, w1, w2, weights, ids)
        err = rel_error(out, moe_reference(x, w1, w2, weights, ids))
        assert err < 1e-2, f"{model} M={m}: relative error {err:.2e}"


def _check_replays(run, x, weights, ids, e, topk, trials, reference=None):
    """Capture ``run`` once; per trial copy fresh hidden states and routing into the same buffers,
    replay, and assert the graph's output equals an eager call bit for bit (and ``reference()``
    within bf16 tolerance, when given)."""
    graph, out = capture_cuda_graph(run)
    for trial in range(trials):
        x.copy_(torch.randn_like(x))
        new_weights, new_ids = _routing(x.shape[0], e, topk)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run()), f"replay {trial} differs from eager"
        if reference is not None:
            assert_close(out, reference(), torch.bfloat16, name=f"replay {trial}")


def _standard_kernel():
    return tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts())


def _batched_kernel(m, topk, e):
    return tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(m * topk, e), tmoe.BatchedTritonExperts(m * topk))


@pytest.mark.parametrize("fmt", ["standard", "batched"])
@pytest.mark.parametrize("m", [1, 16, 128])
def test_cuda_graph_replay_with_new_routing(m, fmt):
    e, n, k, topk = 16, 256, 512, 4
    w1, w2 = _weights(e, n, k)
    kernel = _standard_kernel() if fmt == "standard" else _batched_kernel(m, topk, e)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(m, e, topk)
    kernel.warmup(m, w1, w2, topk)
    _check_replays(lambda: kernel(x, w1, w2, weights, ids), x, weights, ids, e, topk, trials=3,
                   reference=lambda: moe_reference(x, w1, w2, weights, ids))


def test_compile_reduce_overhead_uses_cudagraphs():
    from torch._dynamo.utils import counters

    e, n, k, topk = 8, 256, 512, 2
    w1, w2 = _weights(e, n, k)
    counters.clear()
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, i: tmoe.fused_experts(x, w1, w2, w, i) * 2.0, mode="reduce-overhead",
                       fullgraph=True)
    for m in (16, 16, 16, 64, 64, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weights, ids = _routing(m, e, topk)
        out = fn(x, weights, ids).clone()
        assert_close(out, 2.0 * moe_reference(x, w1, w2, weights, ids), torch.bfloat16)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.parametrize("fmt", ["standard", "batched", "decode"])
def test_forward_has_no_host_syncs(fmt):
    e, n, k, topk, m = 8, 256, 512, 2, 4 if fmt == "decode" else 33
    w1, w2 = _weights(e, n, k)
    kernel = _batched_kernel(m, topk, e) if fmt == "batched" else _standard_kernel()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(m, e, topk)
    kernel(x, w1, w2, weights, ids)  # compile kernels first: JIT may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernel(x, w1, w2, weights, ids)
        tmoe.fused_experts(x, w1, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.large_memory
def test_int64_addressing_past_2_pow_31_elements():
    """M * topk * K = 2**31 + 2**21 elements in the down-GEMM output."""
    e, n, k, topk = 2, 64, 4096, 2
    m = 2**31 // (topk * k) + 256
    w1, w2 = _weights(e, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(m, e, topk)
    kernel = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(), chunk_size=m)
    out = kernel(x, w1, w2, weights, ids)  # one chunk: offsets really pass 2**31
    for rows in (slice(0, 64), slice(m - 64, m)):
        ref = moe_reference(x[rows], w1, w2, weights[rows], ids[rows])
        assert_close(out[rows], ref, torch.bfloat16, name=f"out[{rows}]")


def test_wrong_device_raises():
    p = make_problem(MoEShape(4, 4, 64, 64, 2), torch.bfloat16, "uniform", seed=0, device="cuda")
    with pytest.raises(ValueError, match="w1"):
        tmoe.fused_experts(p.x, p.w1.cpu(), p.w2, p.topk_weights, p.topk_ids)
    with pytest.raises(ValueError, match="topk_ids"):
        tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids.cpu())


FP8_SCHEMES = {
    "block": (tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(128, 128)), tmoe.quantize_weight_per_block_fp8),
    "token": (tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, per_act_token_quant=True, per_out_ch_quant=True),
              tmoe.quantize_weight_per_channel_fp8),
}


def _dequantized(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """bf16 weights of fp8 codes ``q`` and their scales (per block, else per channel)."""
    from tmoe.reference import dequantize_fp8_reference

    return (dequantize_fp8_reference(q, s, block) if block else q.float() * s).to(torch.bfloat16)


@pytest.mark.large_memory
@pytest.mark.parametrize("scheme", list(FP8_SCHEMES))
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_model_shapes_fp8(model, scheme):
    """fp8 layer vs the float32 reference on the dequantized weights; rel. error < 6e-2."""
    e, n, k, topk = MODEL_SHAPES[model]
    config, quantize = FP8_SCHEMES[scheme]
    gc.collect()
    torch.cuda.empty_cache()
    block = config.block_shape

    def quantized(rows: int, cols: int):
        """fp8 weights, scales and bf16 dequantized weights, made 16 experts at a time (memory)."""
        parts = []
        for _ in range(0, e, 16):
            w = torch.randn(min(16, e - len(parts) * 16), rows, cols, device="cuda", dtype=torch.bfloat16) / cols**0.5
            q, s = quantize(w)
            parts.append((q, s, _dequantized(q, s, block)))
        return [torch.cat(t) for t in zip(*parts)]

    w1q, s1, w1d = quantized(2 * n, k)
    w2q, s2, w2d = quantized(k, n)
    for m in (1, 8, 64, 1024):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weights, ids = _routing(m, e, topk)
        out = tmoe.fused_experts(x, w1q, w2q, weights, ids, quant_config=config, w1_scale=s1, w2_scale=s2)
        err = rel_error(out, moe_reference(x, w1d, w2d, weights, ids))
        assert err < 6e-2, f"{model} {scheme} M={m}: relative error {err:.2e}"


def test_fp8_cuda_graph_replay():
    e, n, k, topk, m = 16, 256, 512, 4, 32
    config, quantize = FP8_SCHEMES["block"]
    w1, w2 = _weights(e, n, k)
    (w1q, s1), (w2q, s2) = quantize(w1), quantize(w2)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(m, e, topk)
    run = lambda: tmoe.fused_experts(x, w1q, w2q, weights, ids, quant_config=config, w1_scale=s1, w2_scale=s2)  # noqa: E731
    _check_replays(run, x, weights, ids, e, topk, trials=2)


def _layer_reference(layer: tmoe.FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """float32 reference of ``layer(x)`` for x (M, K): router logits as the layer computes them
    (a bf16 linear, so the picks match), then routing and experts in float32."""
    from tmoe.reference import topk_route_reference

    weights, ids = topk_route_reference(torch.nn.functional.linear(x, layer.router_weight), layer.routing.topk)
    return moe_reference(x, layer.w1, layer.w2, weights, ids)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile_fullgraph"])
@pytest.mark.parametrize("m", [1, 64])
def test_fused_moe_layer_cuda_graph_replay_with_new_input(m, compiled):
    """FusedMoE with its own router, captured once: a new x (so new routing) copied into the
    static input and replayed equals an eager call bit for bit and the reference within bf16."""
    layer = tmoe.FusedMoE(num_experts=8, hidden_size=256, intermediate_size=384, topk=2, dtype=torch.bfloat16,
                          device="cuda")
    torch._dynamo.reset()
    run = torch.compile(layer, fullgraph=True) if compiled else layer
    x_static = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    graph, out = capture_cuda_graph(lambda: run(x_static))
    for trial in range(2):
        x_new = torch.randn_like(x_static)
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(x_new)), f"replay {trial} differs from the same call run eagerly"
        assert torch.equal(out, layer(x_new)), f"replay {trial} differs from the eager layer"
        assert_close(out, _layer_reference(layer, x_new), torch.bfloat16, name=f"replay {trial}")


TMA_TILES = {  # quant: (up, down) tile configs with TMA weight loads, as the tuner tries them
    "none": ((128, 128, 64, 8, 4), (128, 256, 64, 8, 4)),
    "block": ((64, 64, 128, 4, 4), (64, 256, 128, 8, 3)),
    "token": ((128, 128, 128, 8, 3), (128, 256, 128, 8, 3)),
}


@pytest.mark.parametrize("quant", list(TMA_TILES))
def test_tma_large_tiles_and_graph_replay(quant):
    """Large tiles with TMA weight loads compile and match the reference (fp8: on dequantized
    weights, rel. error < 6e-2), and a captured layer replays new routing bit for bit."""
    from tmoe.config import GemmConfig, MoEConfig, override_config

    e, n, k, topk, m = 8, 1024, 2048, 2, 2048
    w1, w2 = _weights(e, n, k)
    up, down = (GemmConfig(bm, bn, bk, 8, w, s, tma=True) for bm, bn, bk, w, s in TMA_TILES[quant])
    kwargs, tol = {}, 1e-2
    if quant != "none":
        config, quantize = FP8_SCHEMES[quant]
        (w1, s1), (w2, s2) = quantize(w1), quantize(w2)
        kwargs, tol = dict(quant_config=config, w1_scale=s1, w2_scale=s2), 6e-2
        w1d, w2d = _dequantized(w1, s1, config.block_shape), _dequantized(w2, s2, config.block_shape)
    else:
        w1d, w2d = w1, w2
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(m, e, topk)
    with override_config(MoEConfig(up, down)):
        run = lambda: tmoe.fused_experts(x, w1, w2, weights, ids, **kwargs)  # noqa: E731
        err = rel_error(run(), moe_reference(x, w1d, w2d, weights, ids))
        assert err < tol, f"TMA {quant}: relative error {err:.2e}"
        _check_replays(run, x, weights, ids, e, topk, trials=2)
