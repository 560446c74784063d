"""Several LoRA adapters served at once (vLLM's MoE-LoRA contract): stacked factors (L, E, r, C) /
(L, E, C_out, r) and ``lora_ids`` (M,), each token's adapter or -1. Each token's output row against
float64 of the unfused formula with its own adapter (the base alone for -1); adapters rewritten in
place are read at the next call (and the next CUDA-graph replay) with nothing recompiled or
recaptured; bad calls are refused by name before any launch."""
from __future__ import annotations

import contextlib

import pytest
import torch

import tmoe
from tmoe.reference import dequantize_fp8_reference, dequantize_int_reference, moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, half_remote_expert_map, make_problem
from tmoe.testing.tolerance import Tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = MoEShape(13, 4, 48, 40, 2)


def stacked_adapters(num_adapters: int, e: int, rows: int, n: int, k: int, ranks: tuple[int, int], seed: int,
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random stacked factors of w1 (rows = 2N) and w2 of the given ranks (0: none on that weight)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for w, r, (c_in, c_out) in (("w1", ranks[0], (k, rows)), ("w2", ranks[1], (n, k))):
        if r:
            out[f"{w}_lora_a"] = torch.randn(num_adapters, e, r, c_in, generator=g) / c_in ** 0.5
            out[f"{w}_lora_b"] = torch.randn(num_adapters, e, c_out, r, generator=g) / r ** 0.5
    return {name: t.to(DEVICE, dtype) for name, t in out.items()}


def serving_reference(x, w1, w2, topk_weights, topk_ids, adapters: dict, lora_ids: torch.Tensor, scale: float,
                      **options) -> torch.Tensor:
    """float64: each token's row of the reference layer on w + scale * b[l] @ a[l], l its adapter
    (w alone for -1)."""
    out = torch.full((x.shape[0], x.shape[1]), float("nan"), dtype=torch.float64, device=x.device)
    for l in [-1, *range(next(iter(adapters.values())).shape[0])]:
        w = {"w1": w1.double(), "w2": w2.double()}
        if l >= 0:
            for name in ("w1", "w2"):
                if f"{name}_lora_a" in adapters:
                    w[name] = w[name] + scale * adapters[f"{name}_lora_b"][l].double() @ adapters[f"{name}_lora_a"][
                        l].double()
        rows = lora_ids == l
        ref = moe_reference(x.double(), w["w1"], w["w2"], topk_weights.double(), topk_ids, dtype=torch.float64,
                            **options)
        out[rows] = ref[rows]
    return out


def token_adapters(m: int, num_adapters: int, seed: int) -> torch.Tensor:
    """Each token's adapter in [-1, L), every value present when m allows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, num_adapters, (m,), generator=g)
    ids[: num_adapters + 1] = torch.arange(-1, num_adapters)[: m]
    return ids[torch.randperm(m, generator=g)].to(DEVICE, torch.int32)


@pytest.mark.parametrize("route,m,ranks,num_adapters", [
    ("sorted", 13, (8, 4), 3),
    ("slots", 3, (16, 16), 2),
    ("sorted", 29, (0, 5), 4),
    ("sorted", 9, (33, 0), 1),
    ("grouped", 37, (8, 4), 3),  # the grouped core runs one adapter: such calls take the sorted route
    (None, 13, (8, 4), 3),
])
def test_each_token_gets_its_own_adapter(route, m, ranks, num_adapters):
    shape = MoEShape(m, SHAPE.e, SHAPE.n, SHAPE.k, SHAPE.topk)
    p = make_problem(shape, torch.float32, "uniform", seed=m, device=DEVICE)
    adapters = stacked_adapters(num_adapters, shape.e, 2 * shape.n, shape.n, shape.k, ranks, seed=m)
    ids = token_adapters(m, num_adapters, seed=m)
    with torch.no_grad(), tmoe.override_route(route) if route else contextlib.nullcontext():
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, lora_scale=0.5, lora_ids=ids, **adapters)
    ref = serving_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, adapters, ids, 0.5)
    assert_close(out, ref, torch.float32)


def test_swigluoai_interleaved_and_int64_ids():
    p = make_problem(SHAPE, torch.float32, "uniform", seed=3, device=DEVICE)
    adapters = stacked_adapters(2, SHAPE.e, 2 * SHAPE.n, SHAPE.n, SHAPE.k, (8, 8), seed=3)
    ids = token_adapters(SHAPE.m, 2, seed=3).long()
    opts = dict(activation="swigluoai", gate_up_interleaved=True)
    with torch.no_grad():
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, lora_ids=ids, **adapters, **opts)
    assert_close(out, serving_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, adapters, ids, 1.0, **opts),
                 torch.float32)


def test_remote_experts_and_no_adapter_tokens_add_exactly_the_base():
    """With an expert map, remote slots add exactly zero; tokens of no adapter (an id outside [0,
    L): -1, or past the stacked adapters) get the base layer's bits (the call without adapters)."""
    shape = MoEShape(11, 6, 48, 40, 2)
    p = make_problem(shape, torch.float32, "uniform", seed=7, device=DEVICE)
    emap, e_local = half_remote_expert_map(shape.e, DEVICE), (shape.e + 1) // 2
    w1, w2 = p.w1[:e_local].contiguous(), p.w2[:e_local].contiguous()
    adapters = stacked_adapters(3, e_local, 2 * shape.n, shape.n, shape.k, (8, 4), seed=7)
    ids = token_adapters(shape.m, 3, seed=7)
    ids[ids == -1] = torch.tensor([3, -5], dtype=ids.dtype, device=DEVICE).repeat(shape.m)[: int((ids == -1).sum())]
    opts = dict(expert_map=emap, global_num_experts=shape.e)
    with torch.no_grad(), tmoe.override_route("sorted"):
        out = tmoe.fused_experts(p.x, w1, w2, p.topk_weights, p.topk_ids, lora_ids=ids, lora_scale=0.5, **adapters,
                                 **opts)
        base = tmoe.fused_experts(p.x, w1, w2, p.topk_weights, p.topk_ids, **opts)
    assert_close(out, serving_reference(p.x, w1, w2, p.topk_weights, p.topk_ids, adapters, ids.where((ids >= 0) & (ids < 3), -1), 0.5,
                                        **opts), torch.float32)
    none = (ids < 0) | (ids >= 3)
    assert none.any() and torch.equal(out[none], base[none])


@pytest.mark.parametrize("base", ["int4", "fp8_block"])
def test_stacked_adapters_on_quantized_experts(base):
    """Weight-only int4 (zero points) and block-fp8 experts serve stacked adapters: the reference on
    the dequantized weights plus each token's adapter (fp8: the adapters read the rows before their
    quantization, so the reference quantizes the base's input alone)."""
    shape = MoEShape(11, 4, 64 if base == "int4" else 128, 128, 2)  # block fp8: N a multiple of the 128 group
    p = make_problem(shape, torch.float32 if base == "int4" else torch.bfloat16, "uniform", seed=17, device=DEVICE)
    adapters = stacked_adapters(3, shape.e, 2 * shape.n, shape.n, shape.k, (8, 8), seed=17, dtype=p.x.dtype)
    ids = token_adapters(shape.m, 3, seed=17)
    if base == "int4":
        (q1, s1, z1), (q2, s2, z2) = (tmoe.quantize_weight_int4(w, 32, zero_point=True) for w in (p.w1, p.w2))
        kw = dict(quant_config=tmoe.FusedMoEQuantConfig(weight_dtype="int4", group_size=32), w1_scale=s1, w2_scale=s2,
                  w1_zp=z1, w2_zp=z2)
        d1, d2 = dequantize_int_reference(q1, s1, z1, 32, 4), dequantize_int_reference(q2, s2, z2, 32, 4)
        with torch.no_grad():
            out = tmoe.fused_experts(p.x, q1, q2, p.topk_weights, p.topk_ids, lora_ids=ids, **adapters, **kw)
        assert_close(out, serving_reference(p.x, d1, d2, p.topk_weights, p.topk_ids, adapters, ids, 1.0),
                     torch.float32)
        return
    (q1, s1), (q2, s2) = (tmoe.quantize_weight_per_block_fp8(w.float(), (128, 128)) for w in (p.w1, p.w2))
    qc = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(128, 128))
    with torch.no_grad():
        out = tmoe.fused_experts(p.x, q1, q2, p.topk_weights, p.topk_ids, lora_ids=ids, quant_config=qc, w1_scale=s1,
                                 w2_scale=s2, **adapters)
    d1, d2 = dequantize_fp8_reference(q1, s1, (128, 128)), dequantize_fp8_reference(q2, s2, (128, 128))
    ref = serving_reference(p.x.float(), d1, d2, p.topk_weights, p.topk_ids, adapters, ids, 1.0)
    assert_close(out, ref, Tolerance(rel=6e-2, atol=6e-2, rtol=0.2))  # fp8 activations against float64


@pytest.mark.parametrize("m", [1, 5, 37])
def test_serving_rows_are_batch_invariant(m):
    """Under the batch-invariant mode a probe token's row with its adapter is the same bits alone and
    at any place in a batch of other tokens and adapters (RL rollouts served with adapters)."""
    p = make_problem(MoEShape(40, SHAPE.e, SHAPE.n, SHAPE.k, SHAPE.topk), torch.float32, "uniform", seed=31,
                     device=DEVICE)
    adapters = stacked_adapters(3, SHAPE.e, 2 * SHAPE.n, SHAPE.n, SHAPE.k, (8, 4), seed=31)
    ids = token_adapters(40, 3, seed=31)
    call = lambda rows: tmoe.fused_experts(p.x[rows], p.w1, p.w2, p.topk_weights[rows], p.topk_ids[rows],
                                           lora_ids=ids[rows], batch_invariant=True, **adapters)
    with torch.no_grad():
        alone = call(slice(39, 40))
        batch = call(slice(40 - m, 40))
    assert torch.equal(batch[-1:], alone)


def test_adapters_rewritten_in_place_are_read_at_the_next_call():
    """vLLM swaps an adapter by writing its slot of the stacked buffers: the next call of the same
    signature (planned launches, replayed) reads the new factors."""
    p = make_problem(SHAPE, torch.float32, "uniform", seed=5, device=DEVICE)
    adapters = stacked_adapters(2, SHAPE.e, 2 * SHAPE.n, SHAPE.n, SHAPE.k, (8, 4), seed=5)
    ids = token_adapters(SHAPE.m, 2, seed=5)
    call = lambda: tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, lora_ids=ids, **adapters)
    with torch.no_grad():
        call()
        new = stacked_adapters(2, SHAPE.e, 2 * SHAPE.n, SHAPE.n, SHAPE.k, (8, 4), seed=6)
        for name, t in adapters.items():
            t[1].copy_(new[name][1])
        out = call()
    assert_close(out, serving_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, adapters, ids, 1.0),
                 torch.float32)


def test_serving_compiles_fullgraph_without_recompiles():
    """Stacked adapters and lora_ids through torch.compile(fullgraph=True, dynamic=True): eager's
    bits, and a new token count runs the same graph."""
    p = make_problem(SHAPE, torch.float32, "uniform", seed=11, device=DEVICE)
    adapters = stacked_adapters(3, SHAPE.e, 2 * SHAPE.n, SHAPE.n, SHAPE.k, (8, 4), seed=11)
    ids = token_adapters(SHAPE.m, 3, seed=11)

    def layer(x, w, topk_ids, lora_ids):
        return tmoe.fused_experts(x, p.w1, p.w2, w, topk_ids, lora_ids=lora_ids, lora_scale=0.5, **adapters)

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the counters are the process's, across tests
    with torch.no_grad():
        for m in (13, 7):
            args = tuple(t[:m].clone() for t in (p.x, p.topk_weights, p.topk_ids, ids))
            assert torch.equal(compiled(*args), layer(*args))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 16, 256])
def test_serving_bf16_graph_replay_after_an_in_place_swap_gpu(m):
    """bf16, 8 adapters of rank 16, captured once: replays after rewriting an adapter in place
    match the float64 reference with the new factors (nothing recaptured)."""
    shape = MoEShape(m, 16, 256, 512, 4)
    p = make_problem(shape, torch.bfloat16, "uniform", seed=m, device=DEVICE)
    adapters = stacked_adapters(8, shape.e, 2 * shape.n, shape.n, shape.k, (16, 16), seed=m, dtype=torch.bfloat16)
    ids = token_adapters(m, 8, seed=m)
    out = torch.full((m, shape.k), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        for _ in range(2):  # plan and compile outside the capture
            tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, lora_ids=ids, **adapters)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, lora_ids=ids, **adapters))
        new = stacked_adapters(8, shape.e, 2 * shape.n, shape.n, shape.k, (16, 16), seed=m + 1, dtype=torch.bfloat16)
        for name, t in adapters.items():
            t[3].copy_(new[name][3])
        graph.replay()
    ref = serving_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, adapters, ids, 1.0)
    assert_close(out, ref, torch.bfloat16)


def test_bad_serving_calls_are_refused_by_name():
    p = make_problem(SHAPE, torch.float32, "uniform", seed=0, device=DEVICE)
    stacked = stacked_adapters(2, SHAPE.e, 2 * SHAPE.n, SHAPE.n, SHAPE.k, (8, 0), seed=0)
    single = {name: t[0] for name, t in stacked.items()}
    ids = torch.zeros(SHAPE.m, dtype=torch.int32, device=DEVICE)
    run = lambda **kw: tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **kw)
    with pytest.raises(ValueError, match="lora_ids"):  # 4-D factors need the token adapters
        run(**stacked)
    with pytest.raises(ValueError, match="w1_lora_a must be stacked"):
        run(lora_ids=ids, **single)
    with pytest.raises(ValueError, match="lora_ids was given without an adapter"):
        run(lora_ids=ids)
    with pytest.raises(ValueError, match="lora_ids"):
        run(lora_ids=ids[:-1], **stacked)
    with pytest.raises(TypeError, match="lora_ids"):
        run(lora_ids=ids.float(), **stacked)
    with pytest.raises(ValueError, match="w1_lora_b"):
        run(lora_ids=ids, w1_lora_a=stacked["w1_lora_a"], w1_lora_b=stacked["w1_lora_b"][:1])
    with pytest.raises(NotImplementedError, match="forward only"):
        run(lora_ids=ids, **{n: t.clone().requires_grad_() for n, t in stacked.items()})
