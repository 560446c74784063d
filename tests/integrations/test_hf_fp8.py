"""``experts_implementation="tmoe"`` for transformers' fine-grained fp8 experts (``FP8Experts``):
tmoe's block-fp8 layer on the stored fp8 weights and block scales, against the float32 reference
on the dequantized weights (tolerance ``TOLERANCES["fp8"]``: activations quantized to e4m3 in
groups of 128; gradients exactly those of the dequantized layer); modules tmoe cannot run take
their own forward, with a warning naming why."""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tmoe  # noqa: E402
from tests.integrations.hf_tiny import DEVICE  # noqa: E402
import tmoe.integrations.transformers  # noqa: E402,F401  (registers "tmoe")
from tmoe.integrations import hf_fp8, hf_registry  # noqa: E402
from tmoe.reference import dequantize_fp8_reference, moe_reference  # noqa: E402
from tmoe.testing import assert_close  # noqa: E402

finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

E, H, I, TOPK = 4, 256, 128, 2  # noqa: E741  (transformers' names: hidden H, intermediate I)
BLOCK = (128, 128)


def fp8_experts(has_gate: bool = True, hidden_act: str = "silu", **config) -> tuple[torch.nn.Module, tuple]:
    """A ``FP8Experts`` (under transformers' FP8 registry) with random block-fp8 weights, set to
    run "tmoe"; and the dequantized float32 (w1, w2) in tmoe's layout."""
    cfg = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, hidden_act=hidden_act,
                                      **config)
    cfg._experts_implementation = "tmoe"
    cls = use_experts_implementation(experts_class=finegrained.FP8Experts,
                                     experts_interface=finegrained.ALL_FP8_EXPERTS_FUNCTIONS, has_gate=has_gate)
    module = cls(cfg, block_size=BLOCK, has_gate=has_gate)
    module.to(DEVICE)
    rows = 2 * I if has_gate else I
    w1 = torch.randn(E, rows, H, device=DEVICE) / H**0.5
    w2 = torch.randn(E, H, I, device=DEVICE) / I**0.5
    dequantized = []
    for proj, w in (("gate_up_proj" if has_gate else "up_proj", w1), ("down_proj", w2)):
        q, s = tmoe.quantize_weight_per_block_fp8(w, BLOCK)
        getattr(module, proj).data = q
        getattr(module, f"{proj}_scale_inv").data = s
        dequantized.append(dequantize_fp8_reference(q, s, BLOCK))
    return module, tuple(dequantized)


def routing(m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(m, H, dtype=torch.bfloat16, device=DEVICE)
    weights, ids = torch.topk(torch.randn(m, E, device=DEVICE).softmax(-1), TOPK)
    return x, ids, weights


@pytest.mark.parametrize("m", [1, 7, 40])
def test_registered_and_matches_the_dequantized_reference(m):
    assert "tmoe" in finegrained.ALL_FP8_EXPERTS_FUNCTIONS
    module, (w1, w2) = fp8_experts()
    x, ids, weights = routing(m)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = module(x, ids, weights)
    assert not [w for w in caught if "own (eager) forward" in str(w.message)]  # no fallback
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out.float(), moe_reference(x.float(), w1, w2, weights, ids.int()), "fp8")


def test_gpt_oss_clamped_swiglu_and_non_gated_experts():
    module, (w1, w2) = fp8_experts(swiglu_alpha=1.702)
    module.limit = 7.0
    x, ids, weights = routing(9)
    with torch.no_grad():
        out = module(x, ids, weights)
    ref = moe_reference(x.float(), w1, w2, weights, ids.int(), activation="swigluoai", swiglu_alpha=1.702,
                        swiglu_limit=7.0)
    assert_close(out.float(), ref, "fp8")
    module, (w1, w2) = fp8_experts(has_gate=False, hidden_act="relu2")
    with torch.no_grad():
        out = module(x, ids, weights)
    assert_close(out.float(), moe_reference(x.float(), w1, w2, weights, ids.int(), activation="relu2_no_mul"), "fp8")


def test_expert_parallel_sentinels_add_zero():
    """Ids >= E (transformers' expert-parallel sentinels) contribute exactly nothing."""
    module, (w1, w2) = fp8_experts()
    module._is_expert_parallel = True
    x, ids, weights = routing(6)
    ids[::2, 1] = E
    with torch.no_grad():
        out = module(x, ids, weights)
    keep = ids < E
    ref = moe_reference(x.float(), w1, w2, weights * keep, torch.where(keep, ids, 0).int())
    assert_close(out.float(), ref, "fp8")


def test_compiled_fullgraph_matches_eager():
    module, _ = fp8_experts()
    x, ids, weights = routing(8)
    with torch.no_grad():
        eager = module(x, ids, weights)
        torch._dynamo.reset()
        compiled = torch.compile(module, fullgraph=True)(x, ids, weights)
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("change, why", [
    (dict(activation_scheme="static"), "activation scales are 'static'"),
    (dict(block_size=None), "not per block"),
    (dict(gate_softcap=30.0), "softcapped"),
    (dict(limit=7.0), "clamps the gate before its activation"),
])
def test_what_tmoe_cannot_run_takes_its_own_forward(monkeypatch, change, why):
    """The reason is named once per class; the module's own forward answers."""
    module, _ = fp8_experts()
    for name, value in change.items():
        setattr(module, name, value)
    assert why in hf_fp8.fp8_layout(module)
    own = torch.full((3, H), 5.0, dtype=torch.bfloat16)
    monkeypatch.setattr(hf_fp8, "eager_forward", lambda cls: lambda self, x, ids, w: own)
    hf_registry._WARNED.clear()  # each case's reason warns (once per class and reason)
    x, ids, weights = routing(3)
    with torch.no_grad(), pytest.warns(UserWarning, match=why):
        assert module(x, ids, weights) is own


def test_input_and_router_gradients_through_frozen_fp8_experts():
    """Training around frozen fp8 experts (LoRA elsewhere, a trainable router): x and the router
    weights get the gradients of the layer on the dequantized weights; the fp8 weights get none."""
    module, (w1, w2) = fp8_experts()
    x, ids, weights = routing(7)
    x, weights = x.float().requires_grad_(), weights.requires_grad_()
    out = module(x, ids, weights)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, weights), grad_out)
    xr, wr = x.detach().double().requires_grad_(), weights.detach().double().requires_grad_()
    ref = moe_reference(xr, w1.double(), w2.double(), wr, ids.int(), dtype=torch.float64)
    want = torch.autograd.grad(ref, (xr, wr), grad_out.double())
    for name, g, r in zip(("dx", "dtopk_weights"), got, want):
        assert_close(g, r, torch.float32, name=name)
    assert module.gate_up_proj.grad is None and module.down_proj.grad is None


def test_scales_of_another_shape_are_named():
    module, _ = fp8_experts()
    module.down_proj_scale_inv.data = torch.ones(E, 2, 2)
    assert "down_proj_scale_inv has shape (4, 2, 2), not (4, 2, 1)" in hf_fp8.fp8_layout(module)
