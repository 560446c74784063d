"""QLoRA on frozen weight-only low-bit experts (int4 with and without zero points, int8, mxfp4):
the gradients of x, the router weights and the LoRA factors against float64 autograd of the
unfused formula on the dequantized weights; the backward's GEMMs (g's over w2, dX's over w1)
dequantize the codes in their K loops and read the forward's saved pre-activation; a call that
would not save it is refused before any launch."""
from dataclasses import dataclass

import pytest
import torch

import tmoe
from tests.layer.test_lora import GRAD_TOL, Case, _adapters, lora_reference
from tmoe.reference import dequantize_int_reference, dequantize_mxfp4_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GROUP = 32


@dataclass(frozen=True)
class Base:
    scheme: str  # int4, int8, mxfp4
    zero_point: bool = False
    route: str = "sorted"
    dtype: torch.dtype = torch.float32
    activation: str = "silu"
    interleaved: bool = False
    ranks: tuple[int, int] = (8, 16)  # (0, 0): no adapters, the base's input and router gradients alone


BASES = [
    Base("int4", zero_point=True),
    Base("int4", route="slots"),
    Base("int8", zero_point=True, ranks=(0, 4)),
    Base("mxfp4", activation="swigluoai", interleaved=True),  # GPT-OSS's experts
    Base("int4", zero_point=True, ranks=(0, 0)),
    Base("mxfp4", dtype=torch.bfloat16),
]


def quantized(base: Base, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(the layer's codes, scales and zero points of w as keyword fragments, the dequantized float32 w)."""
    if base.scheme == "mxfp4":
        q, s = tmoe.quantize_weight_mxfp4(w.float())
        return dict(q=q, scale=s, zp=None), dequantize_mxfp4_reference(q, s)
    bits = 4 if base.scheme == "int4" else 8
    quantize = tmoe.quantize_weight_int4 if bits == 4 else tmoe.quantize_weight_int8
    q, s, z = quantize(w.float(), GROUP, zero_point=base.zero_point)
    return dict(q=q, scale=s.to(w.dtype), zp=z), dequantize_int_reference(q, s.to(w.dtype), z, GROUP, bits)


@pytest.mark.parametrize("base", BASES, ids=lambda b: f"{b.scheme}-zp{int(b.zero_point)}-{b.route}-{b.activation}-"
                                                       f"{str(b.dtype)[6:]}-r{b.ranks[0]}.{b.ranks[1]}")
def test_qlora_on_frozen_low_bit_experts(base):
    shape = MoEShape(7 if base.route == "slots" else 21, 4, 64, 128, 2)
    p = make_problem(shape, base.dtype, "uniform", seed=23, device=DEVICE)
    (c1, d1), (c2, d2) = quantized(base, p.w1), quantized(base, p.w2)
    qc = tmoe.FusedMoEQuantConfig(weight_dtype=base.scheme, group_size=GROUP)
    layer = dict(quant_config=qc, w1_scale=c1["scale"], w2_scale=c2["scale"], w1_zp=c1["zp"], w2_zp=c2["zp"],
                 activation=base.activation, gate_up_interleaved=base.interleaved)
    x, weights = p.x.clone().requires_grad_(), p.topk_weights.clone().requires_grad_()
    adapters = _adapters(Case("qlora", ranks=base.ranks, dtype=base.dtype), d1, d2, seed=23) if any(base.ranks) else {}
    with tmoe.override_route(base.route):
        out = tmoe.fused_experts(x, c1["q"], c2["q"], weights, p.topk_ids, lora_scale=0.5 if adapters else None,
                                 **layer, **adapters)
    inputs = [x, weights, *adapters.values()]
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    copies = [t.detach().double().requires_grad_() for t in inputs]
    ref = lora_reference(copies[0], d1, d2, copies[1], p.topk_ids, dict(zip(adapters, copies[2:])), 0.5,
                         activation=base.activation, gate_up_interleaved=base.interleaved)
    assert_close(out, ref, base.dtype)
    for name, g, r in zip(("hidden_states", "topk_weights", *adapters), grads,
                          torch.autograd.grad(ref, copies, grad_out.double())):
        assert_close(g, r, GRAD_TOL[base.dtype], name=name)


def test_low_bit_training_without_the_saved_preactivation_is_refused():
    """The backward reads the forward's saved pre-activation: save_preactivation=False is refused by
    name before any launch (eager, and compiled, where the op's autograd setup checks)."""
    p = make_problem(MoEShape(5, 4, 64, 128, 2), torch.float32, "uniform", seed=0, device=DEVICE)
    (c1, _), (c2, _) = (quantized(Base("int4"), w) for w in (p.w1, p.w2))
    qc = tmoe.FusedMoEQuantConfig(weight_dtype="int4", group_size=GROUP)
    x = p.x.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="save_preactivation"):
        tmoe.fused_experts(x, c1["q"], c2["q"], p.topk_weights, p.topk_ids, quant_config=qc, w1_scale=c1["scale"],
                           w2_scale=c2["scale"], save_preactivation=False)
    compiled = torch.compile(lambda x: tmoe.fused_experts(x, c1["q"], c2["q"], p.topk_weights, p.topk_ids,
                                                         quant_config=qc, w1_scale=c1["scale"], w2_scale=c2["scale"],
                                                         save_preactivation=False), backend="aot_eager")
    with pytest.raises(Exception, match="save_preactivation"):
        compiled(x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("scheme", ["mxfp4", "int4"])
def test_qlora_bf16_at_gpu_tiles_gpu(scheme):
    """bf16 QLoRA at sizes past the 128-column dX tiles and the 64-row align blocks (GPT-OSS's
    swigluoai interleaved on mxfp4): x, router and factor gradients against float64."""
    base = Base(scheme, zero_point=scheme == "int4", dtype=torch.bfloat16, activation="swigluoai", interleaved=True,
                ranks=(16, 16))
    shape = MoEShape(300, 8, 256, 512, 4)
    p = make_problem(shape, torch.bfloat16, "uniform", seed=29, device=DEVICE)
    (c1, d1), (c2, d2) = quantized(base, p.w1), quantized(base, p.w2)
    qc = tmoe.FusedMoEQuantConfig(weight_dtype=scheme, group_size=GROUP)
    x, weights = p.x.clone().requires_grad_(), p.topk_weights.clone().requires_grad_()
    adapters = _adapters(Case("qlora-gpu", ranks=base.ranks, dtype=base.dtype), d1, d2, seed=29)
    out = tmoe.fused_experts(x, c1["q"], c2["q"], weights, p.topk_ids, quant_config=qc, w1_scale=c1["scale"],
                             w2_scale=c2["scale"], w1_zp=c1["zp"], w2_zp=c2["zp"], activation="swigluoai",
                             gate_up_interleaved=True, lora_scale=0.5, **adapters)
    inputs = [x, weights, *adapters.values()]
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    copies = [t.detach().double().requires_grad_() for t in inputs]
    ref = lora_reference(copies[0], d1, d2, copies[1], p.topk_ids, dict(zip(adapters, copies[2:])), 0.5,
                         activation="swigluoai", gate_up_interleaved=True)
    assert_close(out, ref, torch.bfloat16)
    for name, g, r in zip(("hidden_states", "topk_weights", *adapters), grads,
                          torch.autograd.grad(ref, copies, grad_out.double())):
        assert_close(g, r, GRAD_TOL[torch.bfloat16], name=name)
