"""The layer's backward: every differentiable input's gradient against float64 autograd of the
reference, for every activation, biases, interleaving, router weight on the input, skewed,
out-of-range and remote routing; dtypes of the gradients as PyTorch gives them."""
import weakref
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import tmoe
from tmoe.config.backward import grad_act_blocks, grad_block_m
from tmoe.reference import dequantize_fp8_reference
from tmoe.testing import assert_close
from tmoe.testing.tolerance import Tolerance
from tmoe.testing.gradients import layer_grads, reference_grads
from tmoe.testing.strategies import MoEShape, half_remote_expert_map, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# each gradient against float64: float32 kernels round their GEMMs once; bf16 ones store operands,
# the recomputed intermediate and its gradient in bf16 (as PyTorch's bf16 autograd would)
GRAD_TOL = {torch.float32: Tolerance(rel=1e-5, atol=1e-5, rtol=1e-3),
            torch.bfloat16: Tolerance(rel=2e-2, atol=2e-2, rtol=0.1)}
ROUTER_TOL = Tolerance(rel=1e-4, atol=1e-5, rtol=1e-3)  # through the softmax, whose float32 rounding adds up


@dataclass(frozen=True)
class Case:
    name: str
    m: int = 7
    e: int = 4
    n: int = 48
    k: int = 40
    topk: int = 2
    routing: str = "uniform"
    activation: str = "silu"
    bias: bool = False
    options: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32


CASES = [
    Case("silu-m1", m=1),
    Case("silu-skewed-m41", m=41, routing="one_hot"),
    Case("silu-empty-experts", m=5, e=6, routing="empty_experts"),
    Case("silu-out-of-range", m=9, routing="out_of_range"),
    Case("silu-clamped", options=dict(swiglu_limit=0.3)),
    Case("gelu-bias", activation="gelu", bias=True),
    Case("gelu_tanh", activation="gelu_tanh", n=130),
    Case("swigluoai-interleaved-bias", activation="swigluoai", bias=True,
         options=dict(swiglu_alpha=1.3, swiglu_limit=0.8, gate_up_interleaved=True)),
    Case("silu_no_mul-bias", activation="silu_no_mul", bias=True),
    Case("gelu_no_mul", activation="gelu_no_mul"),
    Case("relu2_no_mul-bias", activation="relu2_no_mul", bias=True),
    Case("weight-on-input-bias", topk=1, bias=True, options=dict(apply_router_weight_on_input=True)),
    Case("one-expert", e=1, topk=1, m=6),
    Case("odd-sizes", m=11, e=3, n=67, k=71, topk=3, bias=True),
    Case("bf16", m=19, bias=True, dtype=torch.bfloat16),
]


def _inputs(case: Case, seed: int = 0) -> dict:
    p = make_problem(MoEShape(case.m, case.e, case.n, case.k, case.topk), case.dtype, case.routing, seed=seed,
                     device=DEVICE)
    w1 = p.w1[:, : case.n].contiguous() if case.activation.endswith("_no_mul") else p.w1
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    bias = (lambda *s: (0.5 * torch.randn(*s, generator=g)).to(case.dtype).to(DEVICE)) if case.bias else None
    inputs = dict(hidden_states=p.x, w1=w1, w2=p.w2, topk_weights=p.topk_weights, topk_ids=p.topk_ids,
                  w1_bias=bias(case.e, w1.shape[1]) if bias else None, w2_bias=bias(case.e, case.k) if bias else None)
    for name, t in inputs.items():
        if t is not None and t.is_floating_point():
            t.requires_grad_()
    return inputs


def _check(grads: dict, ref: dict, dtype: torch.dtype, inputs: dict) -> None:
    assert grads.keys() == ref.keys()
    for name, g in grads.items():
        assert g.dtype == inputs[name].dtype, f"{name}.grad dtype {g.dtype}, expected {inputs[name].dtype}"
        assert_close(g, ref[name], GRAD_TOL[dtype], name=f"d{name}")


@pytest.mark.parametrize("save", [True, False], ids=["saved", "recomputed"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradients_match_float64_reference(case, save):
    """Both ways of the pre-activation: saved by the forward (the default) and recomputed."""
    inputs = _inputs(case)
    options = dict(activation=case.activation, **case.options)
    grad_out = torch.randn(case.m, case.k, device=DEVICE).to(case.dtype)
    grads = layer_grads(tmoe.fused_experts, inputs, grad_out, save_preactivation=save, **options)
    _check(grads, reference_grads(inputs, grad_out, **options), case.dtype, inputs)


def test_grouped_tile_order_covers_every_tile(monkeypatch):
    """The backward GEMMs run their tiles in grouped order (``sizes.row_group`` row blocks per group):
    with a budget of three row blocks per group, 20 expert row blocks in a grid of 21 (the last group
    partial) and two column blocks of N (moe_grad_act) and of K (moe_grad_input), every tile is
    still computed, against float64."""
    from tmoe.kernels import sizes
    case = Case("grouped", m=40, e=20, n=160, k=300, topk=2)
    monkeypatch.setattr(sizes, "L2_ROWS_BUDGET", 3 * 2 * grad_block_m(case.e) * case.k * 4)  # moe_grad_act's x, go
    assert sizes.row_group(2 * grad_block_m(case.e) * case.k * 4) == 3
    inputs = _inputs(case)
    grad_out = torch.randn(case.m, case.k, device=DEVICE)
    grads = layer_grads(tmoe.fused_experts, inputs, grad_out)
    _check(grads, reference_grads(inputs, grad_out), torch.float32, inputs)


def test_remote_experts_get_zero_gradient():
    """expert_map: slots of remote experts contribute exactly zero to every gradient."""
    case = Case("map", m=9, e=6, bias=True)
    inputs = _inputs(case)
    emap = half_remote_expert_map(case.e, DEVICE)
    for name in ("w1", "w2", "w1_bias", "w2_bias"):  # this rank holds the even experts
        inputs[name] = inputs[name][0::2].detach().requires_grad_()
    options = dict(global_num_experts=case.e, expert_map=emap)
    grad_out = torch.randn(case.m, case.k, device=DEVICE)
    grads = layer_grads(tmoe.fused_experts, inputs, grad_out, **options)
    _check(grads, reference_grads(inputs, grad_out, **options), torch.float32, inputs)
    remote = (inputs["topk_ids"] % 2 == 1)
    assert remote.any() and torch.all(grads["topk_weights"][remote] == 0)


def test_weights_stored_transposed_get_gradients_in_their_layout():
    """Weights kept transposed, (E, K, 2N) and (E, N, K) as transformers stores GPT-OSS's, and read
    as views: dW is written in the stored layout, so the parameters take it with no transposing
    copy, and it equals float64 autograd's (interleaved swigluoai with biases, as GPT-OSS)."""
    case = Case("transposed", m=13, bias=True, activation="swigluoai",
                options=dict(swiglu_alpha=1.3, swiglu_limit=0.8, gate_up_interleaved=True))
    inputs = _inputs(case)
    stored = {n: inputs[n].detach().transpose(1, 2).contiguous().requires_grad_() for n in ("w1", "w2")}
    views = dict(inputs, w1=stored["w1"].transpose(1, 2), w2=stored["w2"].transpose(1, 2))
    options = dict(activation=case.activation, **case.options)
    grad_out = torch.randn(case.m, case.k, device=DEVICE)
    grads = layer_grads(tmoe.fused_experts, views, grad_out, **options)
    assert grads.keys() >= {"w1", "w2"}
    for name in ("w1", "w2"):
        assert grads[name].stride() == views[name].stride(), f"d{name} strides {grads[name].stride()}"
    _check(grads, reference_grads(inputs, grad_out, **options), torch.float32, inputs)
    copies = _Copies(stored["w1"].numel(), stored["w2"].numel())
    out = tmoe.fused_experts(views["hidden_states"], views["w1"], views["w2"], views["topk_weights"], views["topk_ids"],
                             w1_bias=views["w1_bias"], w2_bias=views["w2_bias"], **options)
    with copies:
        out.backward(grad_out)
    assert copies.count == 0, "a weight gradient was copied into its parameter's layout"
    for name in ("w1", "w2"):
        assert torch.equal(stored[name].grad, grads[name].transpose(1, 2))


class _Copies(TorchDispatchMode):
    """Counts copies of a tensor as large as one of ``numels``."""

    def __init__(self, *numels: int):
        super().__init__()
        self.numels, self.count = set(numels), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.clone.default) and args[0].numel() in self.numels:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_no_tokens():
    inputs = _inputs(Case("m0", m=0))
    grads = layer_grads(tmoe.fused_experts, inputs, torch.empty(0, 40, device=DEVICE))
    assert grads["hidden_states"].shape == (0, 40)
    assert torch.all(grads["w1"] == 0) and torch.all(grads["w2"] == 0)


def test_gradients_are_bitwise_reproducible():
    case = Case("repeat", m=33, bias=True)
    inputs = _inputs(case)
    grad_out = torch.randn(case.m, case.k, device=DEVICE)
    first = layer_grads(tmoe.fused_experts, inputs, grad_out)
    second = layer_grads(tmoe.fused_experts, inputs, grad_out)
    for name in first:
        assert torch.equal(first[name], second[name]), f"d{name} differs between two runs"


@pytest.mark.parametrize("router_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layer", ["fused_experts", "modular_kernel"])
def test_half_router_weights_act_as_their_float32_cast(router_dtype, layer):
    """A transformers router gives topk_weights in the model's dtype: taken as their exact float32
    cast, so the output and every gradient are bitwise those of the float32 weights, and the
    router weights' gradient comes back in their own dtype (the cast's gradient)."""
    fn = tmoe.fused_experts if layer == "fused_experts" else tmoe.FusedMoEModularKernel(
        tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts())
    inputs = _inputs(Case("half-router", m=9, bias=True))
    half = inputs["topk_weights"].detach().to(router_dtype).requires_grad_()
    as_float = half.detach().float().requires_grad_()
    grad_out = torch.randn(9, 40, device=DEVICE)
    grads = layer_grads(fn, {**inputs, "topk_weights": half}, grad_out)
    want = layer_grads(fn, {**inputs, "topk_weights": as_float}, grad_out)
    assert grads["topk_weights"].dtype == router_dtype
    assert torch.equal(grads["topk_weights"], want["topk_weights"].to(router_dtype))
    for name in ("hidden_states", "w1", "w2", "w1_bias", "w2_bias"):
        assert torch.equal(grads[name], want[name]), f"d{name} differs from the float32 weights'"
    with torch.no_grad():
        out = fn(inputs["hidden_states"], inputs["w1"], inputs["w2"], half, inputs["topk_ids"])
        assert torch.equal(out, fn(inputs["hidden_states"], inputs["w1"], inputs["w2"], as_float, inputs["topk_ids"]))


def test_frozen_experts_skip_weight_gradients(monkeypatch):
    """LoRA-style: w1/w2 frozen, so the weight-gradient op never runs; x and the router weights still get theirs."""
    import tmoe.ops.backward as backward_ops

    def refuse(*args, **kwargs):
        raise AssertionError("the weight-gradient kernel ran for frozen experts")

    monkeypatch.setattr(backward_ops, "_grad_weight", refuse)
    inputs = _inputs(Case("frozen"))
    inputs["w1"].requires_grad_(False)
    inputs["w2"].requires_grad_(False)
    grad_out = torch.randn(7, 40, device=DEVICE)
    grads = layer_grads(tmoe.fused_experts, inputs, grad_out)
    assert set(grads) == {"hidden_states", "topk_weights"}
    _check(grads, reference_grads(inputs, grad_out), torch.float32, inputs)


def test_frozen_weights_with_trainable_biases_run_no_weight_gemm(monkeypatch):
    """Frozen w1/w2 with trainable biases (PEFT's ``bias="all"``): the biases get their gradients,
    sums over the routed rows, and the weight GEMM never runs."""
    import tmoe.ops.backward as backward_ops

    monkeypatch.setattr(backward_ops, "_grad_weight", lambda *a, **k: pytest.fail("the weight GEMM ran"))
    case = Case("frozen-biases", m=9, bias=True, activation="swigluoai", routing="out_of_range",
                options=dict(swiglu_alpha=1.3, swiglu_limit=0.8, gate_up_interleaved=True))
    inputs = _inputs(case)
    inputs["w1"].requires_grad_(False)
    inputs["w2"].requires_grad_(False)
    options = dict(activation=case.activation, **case.options)
    grad_out = torch.randn(case.m, case.k, device=DEVICE)
    grads = layer_grads(tmoe.fused_experts, inputs, grad_out, **options)
    assert set(grads) == {"hidden_states", "topk_weights", "w1_bias", "w2_bias"}
    _check(grads, reference_grads(inputs, grad_out, **options), torch.float32, inputs)


def test_fused_moe_trains_like_a_reference_module():
    """A few Adam steps of FusedMoE (router included) track the same steps of the float32 reference."""
    torch.manual_seed(3)
    e, k, n, topk, m = 4, 32, 24, 2, 16
    layer = tmoe.FusedMoE(e, k, n, topk, dtype=torch.float32, device=DEVICE).requires_grad_(True)
    ref = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.values(), lr=1e-2)
    x, target = torch.randn(m, k, device=DEVICE), torch.randn(m, k, device=DEVICE)
    for step in range(3):
        loss = (layer(x) - target).square().mean()
        logits = x @ ref["router_weight"].T
        w, ids = tmoe.reference.topk_route_reference(logits, topk)
        # the reference's weights: the same picks, differentiable through the softmax
        w = torch.softmax(logits, -1).gather(1, ids.long())
        w = w / w.sum(-1, keepdim=True)
        ref_loss = (tmoe.reference.moe_reference(x, ref["w1"], ref["w2"], w, ids) - target).square().mean()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item())), f"step {step}"
        for o, l in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            l.backward()
        for name, p in layer.named_parameters():
            assert_close(p.grad, ref[name].grad, ROUTER_TOL if name == "router_weight" else GRAD_TOL[torch.float32],
                         name=f"{name}.grad")
        opt.step()
        ref_opt.step()


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensors the ops return while it is active that are alive at once: after each
    op (``log``) and at the peak (freed when their last reference goes)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.log: list[tuple[str, int]] = []

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t._base is None:
                n = t.untyped_storage().nbytes()
                self.live += n
                weakref.finalize(t, self._free, n)
        self.peak = max(self.peak, self.live)
        self.log.append((func.name(), self.live))
        return out


def test_backward_workspaces_are_released_before_the_weight_gradients():
    """The peak of the backward holds the gradients, grad_h and the align metadata only: the
    recomputed intermediate and the router partials are released before the dW1 GEMM runs (each
    workspace goes once its last reader ran)."""
    p = make_problem(MoEShape(8, 4, 256, 512, 2), torch.float32, "uniform", seed=3, device=DEVICE)
    params = [t.clone().requires_grad_() for t in (p.x, p.w1, p.w2, p.topk_weights)]
    out = tmoe.fused_experts(*params, p.topk_ids)
    grad_out = torch.randn_like(out)
    mode = _LiveBytes()
    with mode:
        grads = torch.autograd.grad(out, params, grad_out)
    ops = [name for name, _ in mode.log]
    assert ops[:2] == ["tmoe::moe_grad_align", "tmoe::moe_grad_act"], ops
    align_bytes = mode.log[0][1]
    act_bytes = mode.log[1][1] - align_bytes  # grad_h (P, 2N), inter (P, N), partial (P, parts) float32
    rows = act_bytes // 4 // (2 * 256 + 256 + grad_act_blocks(256, grad_block_m(4)))  # P aligned rows
    grad_h_bytes = rows * 2 * 256 * 4
    grad_bytes = sum(g.untyped_storage().nbytes() for g in grads)
    assert mode.peak <= grad_bytes + grad_h_bytes + align_bytes, (mode.peak, grad_bytes, grad_h_bytes, align_bytes)


FP8_CASES = [
    Case("fp8-silu", m=9, n=128, k=256),
    Case("fp8-skewed-m41-out-of-range", m=41, n=128, k=256, routing="out_of_range"),
    Case("fp8-swigluoai-interleaved-bias", m=7, n=256, k=128, activation="swigluoai", bias=True,
         options=dict(swiglu_alpha=1.3, swiglu_limit=0.8, gate_up_interleaved=True)),
    Case("fp8-relu2_no_mul", m=5, n=128, k=128, activation="relu2_no_mul"),
    Case("fp8-weight-on-input", m=6, n=128, k=256, topk=1, options=dict(apply_router_weight_on_input=True)),
    Case("fp8-bf16", m=19, n=128, k=256, bias=True, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c.name)
def test_frozen_block_fp8_experts_give_input_and_router_gradients(case):
    """QLoRA-style: frozen block-fp8 w1/w2 (with their 128 x 128 scales) give the gradients of x,
    topk_weights and the biases of the layer on the dequantized weights (the backward dequantizes
    in its kernels and does not quantize x: a straight-through estimate of the activations'
    quantization), against float64 autograd on those weights."""
    inputs = _inputs(case)
    qc = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(128, 128))
    quantized, dequantized = {}, {}
    for name in ("w1", "w2"):
        q, s = tmoe.quantize_weight_per_block_fp8(inputs[name].detach().float(), (128, 128))
        quantized[name], quantized[f"{name}_scale"] = q, s
        dequantized[name] = dequantize_fp8_reference(q, s, (128, 128)).to(case.dtype)
    options = dict(activation=case.activation, **case.options)
    grad_out = torch.randn(case.m, case.k, device=DEVICE).to(case.dtype)
    ours = dict(inputs, w1=quantized["w1"], w2=quantized["w2"])
    grads = layer_grads(tmoe.fused_experts, ours, grad_out, quant_config=qc, w1_scale=quantized["w1_scale"],
                        w2_scale=quantized["w2_scale"], **options)
    ref = reference_grads(dict(inputs, w1=dequantized["w1"], w2=dequantized["w2"]), grad_out, **options)
    assert grads.keys() == {"hidden_states", "topk_weights"} | ({"w1_bias", "w2_bias"} if case.bias else set())
    for name, g in grads.items():
        assert g.dtype == inputs[name].dtype
        assert_close(g, ref[name], GRAD_TOL[case.dtype], name=f"d{name}")
