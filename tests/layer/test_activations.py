"""The activations against the float32 reference on every route: non-gated (w1 (E, N, K)),
swigluoai with its alpha and limit, the clamped silu, gate/up rows interleaved; fp8 with the
up GEMM's epilogue quantization; runtime floats under torch.compile."""
import contextlib
from dataclasses import dataclass, field

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tmoe
from tmoe.config import GemmConfig, MoEConfig, override_config
from tmoe.reference import dequantize_fp8_reference, moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUTS = ["sorted", "direct", "slots", "fused", "batched"]
FP8_LAYOUTS = ["sorted", "direct", "slots", "batched"]  # the fused decode kernel takes no fp8 activations


@dataclass(frozen=True)
class Act:
    activation: str
    options: dict = field(default_factory=dict)  # swiglu_alpha, swiglu_limit, gate_up_interleaved
    bias: bool = False

    def __str__(self) -> str:
        return "-".join([self.activation, *(f"{k}={v}" for k, v in self.options.items())] + ["bias"] * self.bias)

    def w1(self, w1: torch.Tensor) -> torch.Tensor:
        """(E, N, K) for a non-gated activation (the first N rows of the problem's (E, 2N, K))."""
        return w1[:, : w1.shape[1] // 2].contiguous() if self.activation.endswith("_no_mul") else w1


ACTS = [
    Act("silu_no_mul"),
    Act("gelu_no_mul"),
    Act("relu2_no_mul", bias=True),
    Act("swigluoai", dict(swiglu_alpha=1.3, swiglu_limit=0.4), bias=True),
    Act("swigluoai", dict(gate_up_interleaved=True, swiglu_alpha=1.1, swiglu_limit=0.6), bias=True),  # GPT-OSS
    Act("silu", dict(swiglu_limit=0.3)),
    Act("silu", dict(gate_up_interleaved=True), bias=True),
    Act("gelu_tanh", dict(gate_up_interleaved=True)),
]


def run_layout(layout: str, x, w1, w2, weights, ids, **kwargs) -> torch.Tensor:
    """The layer on one row layout: a Standard-format route (sorted, direct, slots, fused), or batched."""
    if layout == "batched":
        m, topk = ids.shape
        kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(m * topk, w1.shape[0]),
                                            tmoe.BatchedTritonExperts(m * topk, kwargs.pop("quant_config", None)))
        return kernel(x, w1, w2, weights, ids, **kwargs)
    with tmoe.override_route(layout):
        return tmoe.fused_experts(x, w1, w2, weights, ids, **kwargs)


# float32 on every layout; bf16 and TMA tiles where they take another code path
VARIANTS = [(layout, "float32") for layout in LAYOUTS] + [("sorted", "bfloat16"), ("sorted", "float32-tma"),
                                                           ("batched", "float32-tma")]


@pytest.mark.parametrize("layout, variant", VARIANTS, ids=[f"{layout}-{variant}" for layout, variant in VARIANTS])
@pytest.mark.parametrize("act", ACTS, ids=str)
def test_activation_matches_reference(act, layout, variant):
    """N=40 (a ragged last tile) over K=64; "tma": 32-wide tiles read by TMA where it applies
    (interleaved gate/up rows fall back to pointers)."""
    dtype = torch.bfloat16 if variant == "bfloat16" else torch.float32
    p = make_problem(MoEShape(6, 4, 40, 64, 2), dtype, "out_of_range", seed=len(str(act)), device=DEVICE)
    w1 = act.w1(p.w1)
    kwargs = dict(activation=act.activation, **act.options)
    if act.bias:
        kwargs.update(w1_bias=torch.randn(4, w1.shape[1], device=DEVICE).to(dtype),
                      w2_bias=torch.randn(4, 64, device=DEVICE).to(dtype))
    tma = variant.endswith("tma")
    tiles = MoEConfig(GemmConfig(16, 32, 32, tma=tma), GemmConfig(16, 32, 32, tma=tma))
    with override_config(tiles) if tma else contextlib.nullcontext():
        out = run_layout(layout, p.x, w1, p.w2, p.topk_weights, p.topk_ids, **kwargs)
    assert_close(out, moe_reference(p.x, w1, p.w2, p.topk_weights, p.topk_ids, **kwargs), dtype, name=str(act))


TRANSPOSED_ACTS = [Act("silu"), Act("swigluoai", dict(swiglu_alpha=1.3, swiglu_limit=0.4), bias=True),
                   Act("swigluoai", dict(gate_up_interleaved=True, swiglu_alpha=1.1, swiglu_limit=0.6), bias=True),
                   Act("relu2_no_mul", bias=True)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("act", TRANSPOSED_ACTS, ids=str)
def test_weights_stored_transposed(act, layout):
    """w1 and w2 read as transposed views of their storage (transformers keeps GPT-OSS's as (E, K, 2N)
    and (E, N, K)): the up GEMM reads W1's gate rows and up rows as two contiguous runs of the stored
    dimension, not alternating rows; N=40 leaves a ragged last tile in both runs."""
    p = make_problem(MoEShape(6, 4, 40, 64, 2), torch.float32, "out_of_range", seed=len(str(act)), device=DEVICE)
    w1, w2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (act.w1(p.w1), p.w2))
    assert w1.stride(1) == 1 and w2.stride(1) == 1
    kwargs = dict(activation=act.activation, **act.options)
    if act.bias:
        kwargs.update(w1_bias=torch.randn(4, w1.shape[1], device=DEVICE), w2_bias=torch.randn(4, 64, device=DEVICE))
    out = run_layout(layout, p.x, w1, w2, p.topk_weights, p.topk_ids, **kwargs)
    assert_close(out, moe_reference(p.x, w1, w2, p.topk_weights, p.topk_ids, **kwargs), torch.float32, name=str(act))


@pytest.mark.parametrize("layout", ["sorted", "direct", "slots", "fused"])  # the Batched prepare refuses the option
def test_no_mul_router_weight_on_input(layout):
    """apply_router_weight_on_input scales the input of a non-gated activation (relu² is not
    homogeneous of degree 1, so the weight's place shows)."""
    p = make_problem(MoEShape(9, 4, 40, 64, 1), torch.float32, "uniform", seed=3, device=DEVICE)
    weights = torch.rand_like(p.topk_weights) + 0.5
    kwargs = dict(activation="relu2_no_mul", apply_router_weight_on_input=True)
    w1 = p.w1[:, :40].contiguous()
    out = run_layout(layout, p.x, w1, p.w2, weights, p.topk_ids, **kwargs)
    assert_close(out, moe_reference(p.x, w1, p.w2, weights, p.topk_ids, **kwargs), torch.float32)


FP8_ACTS = [Act("silu_no_mul"), Act("gelu_no_mul"), Act("relu2_no_mul"), Act("silu", dict(swiglu_limit=0.3)),
            Act("silu", dict(gate_up_interleaved=True)), Act("gelu_tanh"),
            Act("swigluoai", dict(swiglu_alpha=1.3, swiglu_limit=0.4), bias=True),
            Act("swigluoai", dict(gate_up_interleaved=True, swiglu_alpha=1.1, swiglu_limit=0.6), bias=True)]


@pytest.mark.parametrize("layout", FP8_LAYOUTS)
@pytest.mark.parametrize("act", FP8_ACTS, ids=str)
def test_fp8_epilogue_quant(act, layout, monkeypatch):
    """Block fp8 with the up GEMM quantizing its activated tile in the epilogue (block_n 128): no
    separate quant stage runs, and the layer matches the float32 reference on dequantized weights."""
    import tmoe.modular.experts

    def fail(*args, **kwargs):
        raise AssertionError("the intermediate must be quantized in the up GEMM's epilogue")

    monkeypatch.setattr(tmoe.modular.experts, "quantize_activations", fail)
    block = (128, 128)
    qc = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=block)
    p = make_problem(MoEShape(9, 4, 128, 128, 2), torch.bfloat16, "uniform", seed=4, device=DEVICE)
    w1 = act.w1(p.w1)
    (w1q, s1), (w2q, s2) = (tmoe.quantize_weight_per_block_fp8(w, block) for w in (w1, p.w2))
    kwargs = dict(activation=act.activation, **act.options)
    if act.bias:
        kwargs.update(w1_bias=torch.randn(4, w1.shape[1], device=DEVICE).to(torch.bfloat16))
    with override_config(MoEConfig(GemmConfig(16, 128, 128), GemmConfig(16, 64, 128))):
        out = run_layout(layout, p.x, w1q, w2q, p.topk_weights, p.topk_ids, quant_config=qc, w1_scale=s1,
                         w2_scale=s2, **kwargs)
    ref = moe_reference(p.x, dequantize_fp8_reference(w1q, s1, block), dequantize_fp8_reference(w2q, s2, block),
                        p.topk_weights, p.topk_ids, **kwargs)
    assert_close(out, ref, "fp8", name=str(act))


@pytest.mark.parametrize("route_name", ["sorted", "direct"])
def test_fp8_per_token_no_mul(route_name):
    """Per-token fp8: the (M * topk, N) intermediate of a non-gated activation is quantized by the
    separate quant stage."""
    qc = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, per_act_token_quant=True, per_out_ch_quant=True)
    p = make_problem(MoEShape(9, 4, 64, 64, 2), torch.bfloat16, "uniform", seed=5, device=DEVICE)
    w1 = p.w1[:, :64].contiguous()
    (w1q, s1), (w2q, s2) = (tmoe.quantize_weight_per_channel_fp8(w) for w in (w1, p.w2))
    with tmoe.override_route(route_name):
        out = tmoe.fused_experts(p.x, w1q, w2q, p.topk_weights, p.topk_ids, quant_config=qc, w1_scale=s1,
                                 w2_scale=s2, activation="gelu_no_mul")
    ref = moe_reference(p.x, w1q.float() * s1, w2q.float() * s2, p.topk_weights, p.topk_ids, activation="gelu_no_mul")
    assert_close(out, ref, "fp8")


VALUES = [(1.702, 7.0), (1.3, 0.4), (2.0, 0.25)]


def test_new_alpha_and_limit_compile_correctly():
    """A new swiglu_alpha/swiglu_limit under torch.compile gives the new value's result. With
    backend="eager" the floats stay symbolic (Scalar schema arguments): one graph for all values;
    an AOT backend (aot_eager, inductor) specialises floats reaching a custom op: one retrace per
    new value."""
    p = make_problem(MoEShape(7, 4, 40, 64, 3), torch.float32, "uniform", seed=6, device=DEVICE)
    args = (p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)

    def layer(x, w1, w2, weights, ids, alpha, limit):
        return tmoe.fused_experts(x, w1, w2, weights, ids, activation="swigluoai", swiglu_alpha=alpha,
                                  swiglu_limit=limit)

    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
        for alpha, limit in VALUES:
            ref = moe_reference(*args, activation="swigluoai", swiglu_alpha=alpha, swiglu_limit=limit)
            assert_close(compiled(*args, alpha, limit), ref, torch.float32, name=f"{backend} ({alpha}, {limit})")
        if backend == "eager":
            assert counter.frame_count == 1, f"a new alpha/limit recompiled: {counter.frame_count} frames"


def test_fused_moe_module_attribute_values():
    """FusedMoE holds its activation as one value attribute; compiled, a changed value is honoured
    (never a stale specialisation), with one graph under backend="eager"."""
    layer = tmoe.FusedMoE(4, 64, 40, 2, activation="silu", swiglu_limit=0.3, dtype=torch.float32, device=DEVICE)
    x = torch.randn(5, 64, device=DEVICE)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for limit in (0.3, 0.1, 0.05):
        layer.activation = dataclasses.replace(layer.activation, limit=limit)
        weights, ids = layer.route(x @ layer.router_weight.T)
        ref = moe_reference(x, layer.w1, layer.w2, weights, ids, activation="silu", swiglu_limit=limit)
        assert_close(compiled(x), ref, torch.float32, name=f"limit={limit}")
    assert counter.frame_count == 1, f"a new limit recompiled: {counter.frame_count} frames"


def test_fused_moe_no_mul_and_interleaved_weights():
    """FusedMoE sizes w1 by the activation; from_experts lays gate/up rows as the layer reads them."""
    e, k, n = 4, 64, 40
    assert tmoe.FusedMoE(e, k, n, 2, activation="relu2_no_mul", dtype=torch.float32).w1.shape == (e, n, k)
    gate, up, down = ([torch.randn(*s, device=DEVICE) / 8 for _ in range(e)] for s in ((n, k), (n, k), (k, n)))
    x, router = torch.randn(6, k, device=DEVICE), torch.randn(e, k, device=DEVICE)
    outs = []
    for interleaved in (False, True):
        layer = tmoe.FusedMoE.from_experts(gate, up, down, 2, router_weight=router, gate_up_interleaved=interleaved)
        outs.append(layer(x))
    assert_close(outs[1], outs[0], torch.float32, name="interleaved vs halves")


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS, ids=str)
def test_gpu_activations_and_no_new_kernel_per_value(act):
    """bf16 at a model-like shape with TMA tiles; a new alpha/limit compiles no new kernel variant."""
    from tmoe.kernels import moe_gemm

    e, n, k, topk, m = 8, 512, 1024, 2, 64
    p = make_problem(MoEShape(m, e, n, k, topk), torch.bfloat16, "uniform", seed=7, device="cuda")
    w1 = act.w1(p.w1)
    kwargs = dict(activation=act.activation, **act.options)
    tiles = MoEConfig(GemmConfig(64, 64, 64, tma=True), GemmConfig(64, 64, 64, tma=True))
    with override_config(tiles):
        out = tmoe.fused_experts(p.x, w1, p.w2, p.topk_weights, p.topk_ids, **kwargs)
        assert_close(out, moe_reference(p.x, w1, p.w2, p.topk_weights, p.topk_ids, **kwargs), torch.bfloat16)
        if "swiglu_limit" not in act.options:
            return
        cache = moe_gemm._moe_gemm_kernel.device_caches[torch.cuda.current_device()][0]
        before = len(cache)
        kwargs.update(swiglu_limit=act.options["swiglu_limit"] * 2)
        out = tmoe.fused_experts(p.x, w1, p.w2, p.topk_weights, p.topk_ids, **kwargs)
        assert len(cache) == before, "a new swiglu_limit compiled a new kernel variant"
        assert_close(out, moe_reference(p.x, w1, p.w2, p.topk_weights, p.topk_ids, **kwargs), torch.bfloat16)
