"""LoRA adapters on the experts (``w1_lora_a`` ... ``lora_scale``): the output and every gradient
(x, router weights, the four factors) against float64 autograd of the unfused formula
w + scale * b @ a; the frozen base gets no gradient and its weight-gradient GEMMs do not run; a
slot no local expert computes adds exactly zero; bad adapters are refused before any launch."""
from dataclasses import dataclass, field

import pytest
import torch

import tmoe
from tmoe.reference import dequantize_fp8_reference, dequantize_int_reference, moe_reference
from tmoe.testing import RecordOps, assert_close
from tmoe.testing.strategies import MoEShape, half_remote_expert_map, make_problem
from tmoe.testing.tolerance import Tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRAD_TOL = {torch.float32: Tolerance(rel=1e-5, atol=1e-5, rtol=1e-3),
            torch.bfloat16: Tolerance(rel=2e-2, atol=2e-2, rtol=0.1)}
FACTORS = ("w1_lora_a", "w1_lora_b", "w2_lora_a", "w2_lora_b")


@dataclass(frozen=True)
class Case:
    name: str
    shape: MoEShape = MoEShape(13, 4, 48, 40, 2)
    ranks: tuple[int, int] = (8, 4)  # w1's and w2's (0: no adapter on that weight)
    scale: float | None = 0.5
    route: str = "sorted"
    routing: str = "uniform"
    activation: str = "silu"
    options: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    save_preactivation: bool = True  # False: the backward recomputes it (with w1's adapter term)


CASES = [
    Case("sorted"),
    Case("slots-m3", shape=MoEShape(3, 4, 48, 40, 2), route="slots"),
    Case("grouped", shape=MoEShape(37, 4, 48, 40, 2), route="grouped"),
    Case("grouped-w2-only-weight-on-input", shape=MoEShape(21, 4, 48, 40, 1), ranks=(0, 5), route="grouped",
         options=dict(apply_router_weight_on_input=True)),
    Case("w1-only-rank-1", ranks=(1, 0), scale=None),
    Case("w2-only-rank-33", ranks=(0, 33), scale=2.0, routing="one_hot"),
    Case("swigluoai-interleaved", activation="swigluoai", options=dict(gate_up_interleaved=True)),
    Case("relu2_no_mul", activation="relu2_no_mul", routing="out_of_range"),
    Case("weight-on-input", shape=MoEShape(9, 4, 48, 40, 1), options=dict(apply_router_weight_on_input=True)),
    Case("bf16", dtype=torch.bfloat16),  # a half-precision rank-deep dot (the scale applied in float32)
    Case("recomputed", save_preactivation=False),
    Case("recomputed-swigluoai-interleaved", activation="swigluoai", options=dict(gate_up_interleaved=True),
         save_preactivation=False),
    Case("recomputed-gelu_no_mul-grouped", activation="gelu_no_mul", route="grouped", save_preactivation=False),
    Case("recomputed-weight-on-input-slots", shape=MoEShape(4, 4, 48, 40, 1), route="slots",
         options=dict(apply_router_weight_on_input=True), save_preactivation=False),
]


def _adapters(case: Case, w1: torch.Tensor, w2: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """Random factors of the case's ranks (b not zero, as after some training), requiring grad."""
    g = torch.Generator().manual_seed(seed)
    (e, rows, k), n = w1.shape, w2.shape[2]
    shapes = {"w1": ((e, case.ranks[0], k), (e, rows, case.ranks[0])), "w2": ((e, case.ranks[1], n), (e, k, case.ranks[1]))}
    out = {}
    for w, (a_shape, b_shape), r in zip(("w1", "w2"), shapes.values(), case.ranks):
        if r:
            out[f"{w}_lora_a"] = torch.randn(a_shape, generator=g) / a_shape[2] ** 0.5
            out[f"{w}_lora_b"] = torch.randn(b_shape, generator=g) / r ** 0.5
    return {name: t.to(device=DEVICE, dtype=case.dtype).requires_grad_() for name, t in out.items()}


def lora_reference(x, w1, w2, topk_weights, topk_ids, adapters: dict, scale: float | None, **options):
    """The unfused formula in float64: the reference layer on w + scale * b @ a."""
    s = 1.0 if scale is None else scale
    w = {"w1": w1.double(), "w2": w2.double()}
    for name in ("w1", "w2"):
        if f"{name}_lora_a" in adapters:
            w[name] = w[name] + s * adapters[f"{name}_lora_b"].double() @ adapters[f"{name}_lora_a"].double()
    return moe_reference(x.double(), w["w1"], w["w2"], topk_weights.double(), topk_ids, dtype=torch.float64, **options)


def _check_case(case: Case, seed: int) -> None:
    p = make_problem(case.shape, case.dtype, case.routing, seed=seed, device=DEVICE)
    w1 = p.w1[:, : case.shape.n].contiguous() if case.activation.endswith("_no_mul") else p.w1
    x = p.x.clone().requires_grad_()
    weights = p.topk_weights.clone().requires_grad_()
    adapters = _adapters(case, w1, p.w2, seed)
    options = dict(activation=case.activation, **case.options)
    with tmoe.override_route(case.route):
        out = tmoe.fused_experts(x, w1, p.w2, weights, p.topk_ids, lora_scale=case.scale,
                                 save_preactivation=case.save_preactivation, **adapters, **options)
    grad_out = torch.randn_like(out)
    inputs = [x, weights, *adapters.values()]
    grads = torch.autograd.grad(out, inputs, grad_out)
    copies = [t.detach().double().requires_grad_() for t in inputs]
    ref = lora_reference(copies[0], w1, p.w2, copies[1], p.topk_ids, dict(zip(adapters, copies[2:])), case.scale,
                         **options)
    ref_grads = torch.autograd.grad(ref, copies, grad_out.double())
    assert_close(out, ref, case.dtype)
    for name, g, r in zip(("hidden_states", "topk_weights", *adapters), grads, ref_grads):
        assert g.dtype == inputs[0].dtype or name == "topk_weights", name
        assert_close(g, r, GRAD_TOL[case.dtype], name=name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_lora_output_and_gradients_match_float64(case):
    _check_case(case, seed=hash(case.name) % 1000)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("route", ["slots", "sorted", "grouped"])
def test_lora_bf16_on_gpu(route):
    m = 5 if route == "slots" else 300
    _check_case(Case("gpu", shape=MoEShape(m, 8, 256, 512, 2), ranks=(16, 16), route=route, dtype=torch.bfloat16),
                seed=3)


def test_frozen_base_gets_no_gradient_and_no_weight_gemm():
    """Only the four factors' K-grouped GEMMs run (the base's dW1/dW2 do not); the base is unchanged."""
    case = Case("frozen")
    p = make_problem(case.shape, torch.float32, "uniform", seed=5, device=DEVICE)
    adapters = _adapters(case, p.w1, p.w2, seed=5)
    w1, w2 = p.w1.clone(), p.w2.clone()
    out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, lora_scale=0.5, **adapters)
    with RecordOps() as ops:
        out.sum().backward()
    assert ops.names.count("tmoe::moe_grad_weight") == 4
    assert p.w1.grad is None and p.w2.grad is None
    assert torch.equal(p.w1, w1) and torch.equal(p.w2, w2)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in adapters.values())


def test_remote_slots_add_exactly_zero():
    """With an expert map, slots of remote experts take no LoRA term: the output and the factors'
    gradients are those of the local experts alone (float64 reference with the same map)."""
    shape = MoEShape(11, 6, 48, 40, 2)
    p = make_problem(shape, torch.float32, "uniform", seed=7, device=DEVICE)
    emap, e_local = half_remote_expert_map(shape.e, DEVICE), (shape.e + 1) // 2
    w1, w2 = p.w1[:e_local].contiguous(), p.w2[:e_local].contiguous()
    adapters = _adapters(Case("remote"), w1, w2, seed=7)
    opts = dict(expert_map=emap, global_num_experts=shape.e)
    out = tmoe.fused_experts(p.x, w1, w2, p.topk_weights, p.topk_ids, lora_scale=0.5, **adapters, **opts)
    grads = torch.autograd.grad(out.sum(), list(adapters.values()))
    copies = {n: t.detach().double().requires_grad_() for n, t in adapters.items()}
    ref = lora_reference(p.x, w1, w2, p.topk_weights, p.topk_ids, copies, 0.5, **opts)
    assert_close(out, ref, torch.float32)
    for name, g, r in zip(adapters, grads, torch.autograd.grad(ref.sum(), list(copies.values()))):
        assert_close(g, r, GRAD_TOL[torch.float32], name=name)


BAD = [
    (dict(w1_lora_a=(4, 8, 40)), ValueError, "w1_lora_b is missing"),
    (dict(w1_lora_a=(4, 8, 41), w1_lora_b=(4, 96, 8)), ValueError, "w1_lora_a"),
    (dict(w1_lora_a=(4, 8, 40), w1_lora_b=(4, 95, 8)), ValueError, "w1_lora_b"),
    (dict(w2_lora_a=(4, 129, 48), w2_lora_b=(4, 40, 129)), ValueError, "r <= 128"),
    (dict(w2_lora_a=(3, 4, 48), w2_lora_b=(3, 40, 4)), ValueError, "w2_lora_a"),
]


@pytest.mark.parametrize("shapes,error,match", BAD, ids=lambda v: str(v)[:40])
def test_bad_adapters_are_refused_by_name(shapes, error, match):
    p = make_problem(MoEShape(5, 4, 48, 40, 2), torch.float32, "uniform", seed=0, device=DEVICE)
    adapters = {name: torch.zeros(shape, device=DEVICE) for name, shape in shapes.items()}
    with pytest.raises(error, match=match):
        tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **adapters)


def test_bad_adapter_calls_are_refused():
    p = make_problem(MoEShape(5, 4, 48, 40, 2), torch.float32, "uniform", seed=0, device=DEVICE)
    a, b = torch.zeros(4, 8, 40, device=DEVICE), torch.zeros(4, 96, 8, device=DEVICE)
    with pytest.raises(TypeError, match="w1_lora_a"):  # dtype
        tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, w1_lora_a=a.double(), w1_lora_b=b.double())
    with pytest.raises(ValueError, match="lora_scale"):
        tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, lora_scale=2.0)
    with pytest.raises(ValueError, match="lora_scale"):
        tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, w1_lora_a=a, w1_lora_b=b,
                           lora_scale=float("nan"))
    fp8 = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn)  # per-tensor fp8 serves adapters, its backward does not
    with pytest.raises(NotImplementedError, match="frozen quantized experts"):
        tmoe.fused_experts(p.x.requires_grad_(), p.w1.to(torch.float8_e4m3fn), p.w2.to(torch.float8_e4m3fn),
                           p.topk_weights, p.topk_ids, quant_config=fp8, w1_scale=torch.ones(1, device=DEVICE),
                           w2_scale=torch.ones(1, device=DEVICE), w1_lora_a=a.requires_grad_(), w1_lora_b=b)


def test_lora_compiles_fullgraph_without_recompiles():
    """Adapters through torch.compile(fullgraph=True, dynamic=True): forward and backward equal
    eager's, and a new token count runs the same graph (a new lora_scale, a float reaching a
    custom op, retraces once under an AOT backend, as ``tmoe.modular.call.RuntimeFloat`` says)."""
    case = Case("compiled")
    p = make_problem(MoEShape(9, 4, 48, 40, 2), torch.float32, "uniform", seed=11, device=DEVICE)
    adapters = _adapters(case, p.w1, p.w2, seed=11)

    def layer(x, w, ids, scale):
        return tmoe.fused_experts(x, p.w1, p.w2, w, ids, lora_scale=scale, **adapters)

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the counters are the process's, across tests
    for m, scale in ((9, 0.5), (6, 0.5)):
        x = p.x[:m].clone().requires_grad_()
        w, ids = p.topk_weights[:m].clone(), p.topk_ids[:m].clone()
        got = compiled(x, w, ids, scale)
        want = layer(x, w, ids, scale)
        grads = torch.autograd.grad(got.sum(), [x, *adapters.values()])
        ref = torch.autograd.grad(want.sum(), [x, *adapters.values()])
        torch.testing.assert_close(got, want)
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def _block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, the dequantized float32 weight) at 128 x 128 blocks."""
    q, s = tmoe.quantize_weight_per_block_fp8(w.float(), (128, 128))
    return q, s, dequantize_fp8_reference(q, s, (128, 128))


@pytest.mark.parametrize("route", ["sorted", "slots"])
@pytest.mark.parametrize("save_preactivation", [True, False])
def test_qlora_on_frozen_block_fp8_experts(route, save_preactivation):
    """QLoRA: frozen block-fp8 experts (fp8 activations in the forward) with float adapters; the
    output against the reference on the dequantized weights (fp8 tolerance, the activations are
    quantized), the gradients of x, the router weights and the factors against float64 autograd
    on the dequantized weights (the backward does not quantize x, as for frozen fp8 without LoRA)."""
    case = Case("qlora", shape=MoEShape(7 if route == "slots" else 19, 4, 128, 256, 2), ranks=(8, 16))
    p = make_problem(case.shape, torch.float32, "uniform", seed=13, device=DEVICE)
    (q1, s1, d1), (q2, s2, d2) = _block_fp8(p.w1), _block_fp8(p.w2)
    x, weights = p.x.clone().requires_grad_(), p.topk_weights.clone().requires_grad_()
    adapters = _adapters(case, p.w1, p.w2, seed=13)
    qc = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(128, 128))
    with tmoe.override_route(route):
        out = tmoe.fused_experts(x, q1, q2, weights, p.topk_ids, quant_config=qc, w1_scale=s1, w2_scale=s2,
                                 lora_scale=0.5, save_preactivation=save_preactivation, **adapters)
    inputs = [x, weights, *adapters.values()]
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    copies = [t.detach().double().requires_grad_() for t in inputs]
    ref = lora_reference(copies[0], d1, d2, copies[1], p.topk_ids, dict(zip(adapters, copies[2:])), 0.5)
    assert_close(out, ref, "fp8")
    for name, g, r in zip(("hidden_states", "topk_weights", *adapters), grads,
                          torch.autograd.grad(ref, copies, grad_out.double())):
        assert_close(g, r, GRAD_TOL[torch.float32], name=name)


def test_adapters_on_int4_experts_serve():
    """Inference with adapters on weight-only int4 experts (zero points): the reference on the
    dequantized weights plus the adapters."""
    case = Case("int4", shape=MoEShape(11, 4, 64, 128, 2), ranks=(8, 8))
    p = make_problem(case.shape, torch.float32, "uniform", seed=17, device=DEVICE)
    q1, s1, z1 = tmoe.quantize_weight_int4(p.w1, 32, zero_point=True)
    q2, s2, z2 = tmoe.quantize_weight_int4(p.w2, 32, zero_point=True)
    d1, d2 = dequantize_int_reference(q1, s1, z1, 32, 4), dequantize_int_reference(q2, s2, z2, 32, 4)
    adapters = {n: t.detach() for n, t in _adapters(case, p.w1, p.w2, seed=17).items()}
    qc = tmoe.FusedMoEQuantConfig(weight_dtype="int4", group_size=32)
    out = tmoe.fused_experts(p.x, q1, q2, p.topk_weights, p.topk_ids, quant_config=qc, w1_scale=s1, w2_scale=s2,
                             w1_zp=z1, w2_zp=z2, lora_scale=0.5, **adapters)
    assert_close(out, lora_reference(p.x, d1, d2, p.topk_weights, p.topk_ids, adapters, 0.5), torch.float32)
