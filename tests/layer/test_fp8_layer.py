"""The whole layer in each fp8 scheme against the float32 reference on dequantized weights.

Tolerance (``TOLERANCES["fp8"]``): the activations and the intermediate are quantized to e4m3
(3 mantissa bits, relative step 2**-4), so outputs differ from the reference by a few percent;
the weights' own rounding is removed by comparing with the dequantized weights.
"""
from dataclasses import dataclass

import pytest
import torch

import tmoe
from tmoe.kernels.route import Route
from tmoe.reference import act_and_mul_reference, dequantize_fp8_reference, moe_reference
from tmoe.testing import assert_close, rel_error
from tmoe.testing.strategies import MoEShape, make_problem, route_shape

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Scheme:
    name: str
    config: tmoe.FusedMoEQuantConfig
    static: bool = False


SCHEMES = [
    Scheme("tensor", tmoe.FusedMoEQuantConfig(FP8)),
    Scheme("tensor_static", tmoe.FusedMoEQuantConfig(FP8), static=True),
    Scheme("token", tmoe.FusedMoEQuantConfig(FP8, per_act_token_quant=True, per_out_ch_quant=True)),
    Scheme("block", tmoe.FusedMoEQuantConfig(FP8, block_shape=(128, 128))),
]


def quantize_weights(w: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_fp8, scale, dequantized w in float32) in the scheme's checkpoint layout."""
    if scheme.config.block_shape is not None:
        q, s = tmoe.quantize_weight_per_block_fp8(w, scheme.config.block_shape)
        return q, s, dequantize_fp8_reference(q, s, scheme.config.block_shape)
    if scheme.config.per_out_ch_quant:
        q, s = tmoe.quantize_weight_per_channel_fp8(w)
    else:
        q, s = tmoe.quantize_weight_per_tensor_fp8(w)
        return q, s, q.float() * s.view(-1, 1, 1)
    return q, s, q.float() * s


def run_scheme(p, scheme: Scheme, kernel: tmoe.FusedMoEModularKernel | None = None):
    """(layer output, float32 reference on dequantized weights); ``kernel`` None: tmoe.fused_experts."""
    w1q, s1, w1d = quantize_weights(p.w1, scheme)
    w2q, s2, w2d = quantize_weights(p.w2, scheme)
    static = {}
    if scheme.static:  # static activation scales as a calibrated checkpoint would carry them
        n = w1d.shape[1] // 2
        h = torch.einsum("mk,enk->emn", p.x.float(), w1d)
        inter = act_and_mul_reference(h[..., :n], h[..., n:], "silu")
        absmax = lambda t: torch.cat([t.abs().flatten(), torch.full((1,), 1e-3, device=DEVICE)]).max()  # noqa: E731
        static = dict(a1_scale=(absmax(p.x.float()) / 448).reshape(1), a2_scale=(absmax(inter) / 448).reshape(1))
    if kernel is None:
        out = tmoe.fused_experts(p.x, w1q, w2q, p.topk_weights, p.topk_ids, quant_config=scheme.config,
                                 w1_scale=s1, w2_scale=s2, **static)
    else:
        out = kernel(p.x, w1q, w2q, p.topk_weights, p.topk_ids, w1_scale=s1, w2_scale=s2, **static)
    return out, moe_reference(p.x, w1d, w2d, p.topk_weights, p.topk_ids)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("shape", [MoEShape(1, 4, 128, 256, 2), MoEShape(37, 8, 256, 128, 2),
                                   MoEShape(0, 4, 128, 128, 2), MoEShape(20, 4, 128, 384, 1)], ids=str)
def test_fp8_layer(scheme, shape, fp8_route):
    p = make_problem(route_shape(shape, fp8_route), torch.bfloat16, "out_of_range" if shape.m > 30 else "uniform",
                     seed=shape.m, device=DEVICE)
    out, ref = run_scheme(p, scheme)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, "fp8")


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_fp8_zero_rows_and_tiny_inputs_stay_finite(scheme, fp8_route):
    p = make_problem(MoEShape(9, 4, 128, 128, 2), torch.bfloat16, "uniform", seed=4, device=DEVICE)
    p.x[0] = 0.0
    p.x[1] = 1e-23
    out, ref = run_scheme(p, scheme)
    assert bool(torch.isfinite(out).all()), "all-zero and tiny rows must give finite outputs"
    assert bool((out[0] == 0).all())
    assert_close(out[2:], ref[2:], "fp8")


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if not s.static], ids=lambda s: s.name)
def test_fp8_nan_stays_in_its_token(scheme, fp8_route):
    """A NaN in one token's input reaches exactly that token's output (dynamic scales)."""
    p = make_problem(MoEShape(24, 4, 128, 128, 2), torch.bfloat16, "uniform", seed=6, device=DEVICE)
    p.x[5, 3] = float("nan")
    out, ref = run_scheme(p, scheme)
    bad = ~torch.isfinite(out).all(-1)
    assert bool(bad[5]) and int(bad.sum()) == 1, f"NaN leaked into rows {bad.nonzero().flatten().tolist()}"
    keep = torch.arange(24, device=DEVICE) != 5
    assert_close(out[keep], ref[keep], "fp8")


def test_fp8_batched_format_and_compile():
    scheme = SCHEMES[3]
    p = make_problem(MoEShape(13, 4, 128, 256, 2), torch.bfloat16, "skewed", seed=8, device=DEVICE)
    w1q, s1, w1d = quantize_weights(p.w1, scheme)
    w2q, s2, w2d = quantize_weights(p.w2, scheme)
    ref = moe_reference(p.x, w1d, w2d, p.topk_weights, p.topk_ids)
    kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(26, 4),
                                        tmoe.BatchedTritonExperts(26, scheme.config))
    assert_close(kernel(p.x, w1q, w2q, p.topk_weights, p.topk_ids, w1_scale=s1, w2_scale=s2), ref, "fp8")
    compiled = torch.compile(lambda *a: tmoe.fused_experts(*a, quant_config=scheme.config, w1_scale=s1, w2_scale=s2),
                             fullgraph=True, dynamic=True)
    eager = tmoe.fused_experts(p.x, w1q, w2q, p.topk_weights, p.topk_ids, quant_config=scheme.config,
                               w1_scale=s1, w2_scale=s2)
    assert rel_error(compiled(p.x, w1q, w2q, p.topk_weights, p.topk_ids), eager) == 0.0


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_fp8_batched_single_token(scheme):
    """Batched format, M=1, K=128: dynamic scales have one element but are still per token (or
    per group) and must travel with their rows; a static scale applies to every batch."""
    p = make_problem(MoEShape(1, 4, 128, 128, 2), torch.bfloat16, "uniform", seed=9, device=DEVICE)
    kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(2, 4),
                                        tmoe.BatchedTritonExperts(2, scheme.config))
    out, ref = run_scheme(p, scheme, kernel)
    assert_close(out, ref, "fp8")


def test_fp8_bad_input_raises_before_launch():
    p = make_problem(MoEShape(4, 4, 128, 128, 2), torch.bfloat16, "uniform", seed=1, device=DEVICE)
    w1q, s1, _ = quantize_weights(p.w1, SCHEMES[2])
    w2q, s2, _ = quantize_weights(p.w2, SCHEMES[2])
    args = (p.x, w1q, w2q, p.topk_weights, p.topk_ids)
    with pytest.raises(TypeError, match="w1 .*quant_config"):
        tmoe.fused_experts(*args, w1_scale=s1, w2_scale=s2)  # fp8 weights, no quant config
    with pytest.raises(ValueError, match="w2_scale"):
        tmoe.fused_experts(*args, quant_config=SCHEMES[2].config, w1_scale=s1)
    with pytest.raises(TypeError, match="w1 .*quant config"):
        tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, quant_config=SCHEMES[2].config,
                           w1_scale=s1, w2_scale=s2)  # bf16 weights under an fp8 config


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("layout", ["sorted", "direct", "batched"])
def test_epilogue_quant_equals_group_quant_of_float32_intermediate(layout, tma):
    """The up GEMM's fused 1 x 128 quantization writes exactly the codes and scales that
    ``per_token_group_quant_fp8`` gives for the same GEMM's float32 intermediate (bit for bit:
    same accumulator, same rounding); unwritten elements stay NaN-poisoned and fail."""
    from tmoe.config import GemmConfig
    from tmoe.kernels.operands import Scales
    from tmoe.kernels.operands import DirectRouting, Routing
    from tmoe.kernels.moe_gemm import invoke_moe_gemm
    from tmoe.testing import poison

    block = SCHEMES[3].config.block_shape
    p = make_problem(MoEShape(11, 4, 256, 256, 2), torch.bfloat16, "skewed", seed=12, device=DEVICE)
    w1q, s1, _ = quantize_weights(p.w1, SCHEMES[3])
    cfg = GemmConfig(16, 128, 128, tma=tma)
    n = p.w1.shape[1] // 2
    if layout == "batched":
        cap = 11 * 2
        x = torch.randn(4, cap, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
        counts = torch.tensor([22, 0, 7, 13], dtype=torch.int32, device=DEVICE)
        xq, xs = tmoe.per_token_group_quant_fp8(x, block[1])
        rows, where = (4, cap), dict(expert_num_tokens=counts, route=Route.BATCHED)
        valid = torch.arange(cap, device=DEVICE)[None, :] < counts[:, None]  # [E, cap]
    else:
        xq, xs = tmoe.per_token_group_quant_fp8(p.x, block[1])
        sorted_ids, expert_ids, ntpp = tmoe.moe_align_block_size(p.topk_ids, cfg.block_m, 4)
        routing = (Routing(sorted_ids, expert_ids, ntpp, 22, 2) if layout == "sorted"
                   else DirectRouting(p.topk_ids, 4, a_row_div=2))
        rows, where = (11 * 2,), dict(routing=routing, route=Route.SORTED if layout == "sorted" else Route.SLOTS)
        valid = torch.ones(22, dtype=torch.bool, device=DEVICE)
    scales = Scales(xs, s1, block)
    inter32 = poison(torch.empty(*rows, n, device=DEVICE))
    invoke_moe_gemm(xq, w1q, inter32, cfg, gated=True, scales=scales, **where)
    want_q, want_s = tmoe.per_token_group_quant_fp8(inter32, block[1])
    q = torch.empty(*rows, n, dtype=FP8, device=DEVICE)
    q.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
    s = poison(torch.empty(*rows, n // block[1], device=DEVICE))
    invoke_moe_gemm(xq, w1q, q, cfg, gated=True, scales=scales, out_scale=s, **where)
    assert torch.equal(q.view(torch.uint8)[valid], want_q.view(torch.uint8)[valid])
    assert torch.equal(s[valid], want_s[valid])


def test_layer_with_and_without_epilogue_quant():
    """Block fp8: block_n = 128 (fused intermediate quantization) and block_n = 64 (a separate
    quant stage on the bf16 intermediate) both match the reference."""
    from tmoe.config import GemmConfig, MoEConfig, override_config

    p = make_problem(MoEShape(17, 4, 256, 256, 2), torch.bfloat16, "uniform", seed=13, device=DEVICE)
    for up_bn in (128, 64):
        with override_config(MoEConfig(GemmConfig(16, up_bn, 128), GemmConfig(16, 64, 128))):
            out, ref = run_scheme(p, SCHEMES[3])
        assert_close(out, ref, "fp8", name=f"up block_n={up_bn}")


@pytest.mark.parametrize("scheme", [SCHEMES[2], SCHEMES[3]], ids=lambda s: s.name)
@pytest.mark.parametrize("layout", ["sorted", "direct", "batched"])
def test_fp8_swap_ab(scheme, layout):
    """``GemmConfig.swap_ab``: per-token scales (per column of the transposed tile) and block
    scales per K tile, on every row layout; the up tile's 1 x 128 epilogue quantization (block).
    The kernels see fp8 activations whatever the input dtype: bfloat16 only."""
    from tmoe.config import GemmConfig, MoEConfig, override_config, override_route

    p = make_problem(MoEShape(13, 4, 128, 256, 2), torch.bfloat16, "skewed", seed=10, device=DEVICE)
    cfg = MoEConfig(GemmConfig(16, 128, 64, swap_ab=True), GemmConfig(16, 64, 64, swap_ab=True))
    kernel = None
    if layout == "batched":
        kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(26, 4),
                                            tmoe.BatchedTritonExperts(26, scheme.config))
    with override_config(cfg), override_route("sorted" if layout == "batched" else layout):
        out, ref = run_scheme(p, scheme, kernel)
    assert_close(out, ref, "fp8")


@pytest.mark.parametrize("scheme,pattern", [(SCHEMES[3], "*fp8_w8a8,block_shape*"),
                                            (SCHEMES[2], "*dtype=fp8_w8a8.json")], ids=["block", "token"])
def test_shipped_fp8_swap_tiles(scheme, pattern, shipped_swap_tiles):
    """Every swap_ab tile shape the shipped fp8 tables name (block_m 16/32, block_n 64/128, block_k
    128/256) matches the reference on the sorted route."""
    from tmoe.config import override_config, override_route

    configs = shipped_swap_tiles(pattern)
    assert configs, "the shipped fp8 tables name swap_ab tiles"
    p = make_problem(MoEShape(13, 4, 256, 512, 2), torch.bfloat16, "skewed", seed=21, device=DEVICE)
    for cfg in configs:
        with override_config(cfg), override_route("sorted"):
            out, ref = run_scheme(p, scheme)
        assert_close(out, ref, "fp8", name=str(cfg))
