"""Weight-only int4 / int8 / mxfp4 experts against the float32 reference on dequantized weights.

Tolerance: the kernels dequantize exactly (codes minus zero points, and e2m1 values, are exact in
the activation dtype; bf16/fp16 int4 steps subtract the codes' offset and zero point as a float32
row sum; each group's scale multiplies its K step's float32 product), so the rounding left is the
activation dtype's and float32's: float32 inputs meet ``TOLERANCES["float32"]``, bfloat16 and
float16 ones ``TOLERANCES[dtype]`` (the intermediate is stored in the activation dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tmoe
from tmoe.config import ROUTES
from tmoe.reference import (
    dequantize_int_reference, dequantize_mxfp4_reference, moe_reference, pack_int4_reference, unpack_int4_reference,
)
from tmoe.testing import assert_close, rel_error
from tmoe.testing.strategies import MoEShape, half_remote_expert_map, make_problem
from tmoe.weights import _pack_nibbles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Case:
    scheme: str  # int4, int8, mxfp4
    group: int
    zero_point: bool
    shape: MoEShape
    dtype: torch.dtype
    routing: str = "uniform"
    activation: str = "silu"

    def __str__(self) -> str:
        zp = "zp" if self.zero_point else "nozp"
        return f"{self.scheme}-g{self.group}-{zp}-{self.shape}-{str(self.dtype)[6:]}-{self.routing}-{self.activation}"

    @property
    def config(self) -> tmoe.FusedMoEQuantConfig:
        return tmoe.FusedMoEQuantConfig(weight_dtype=self.scheme, group_size=self.group)


def quantize(w: torch.Tensor, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(codes, scales, zero points or None, float32 dequantized weights) of w (E, rows, K)."""
    if case.scheme == "mxfp4":
        q, s = tmoe.quantize_weight_mxfp4(w)
        return q, s, None, dequantize_mxfp4_reference(q, s)
    quantizer = tmoe.quantize_weight_int4 if case.scheme == "int4" else tmoe.quantize_weight_int8
    q, s, zp = quantizer(w, case.group, zero_point=case.zero_point)
    return q, s, zp, dequantize_int_reference(q, s, zp, case.group, 4 if case.scheme == "int4" else 8)


def run_case(case: Case, kernel: tmoe.FusedMoEModularKernel | None = None, **layer):
    """(layer output, float32 reference on the dequantized weights); ``layer``: expert_map etc.
    A *_no_mul activation takes the first N rows of the problem's (E, 2N, K) w1."""
    p = make_problem(case.shape, case.dtype, case.routing, seed=case.shape.m + case.group, device=DEVICE)
    w1, w2 = p.w1, p.w2
    if case.activation.endswith("_no_mul"):
        w1 = w1[:, : w1.shape[1] // 2].contiguous()
    if "expert_map" in layer:  # this rank holds the even experts
        local = torch.arange(case.shape.e, device=DEVICE)[layer["expert_map"] >= 0]
        w1, w2 = w1[local].contiguous(), w2[local].contiguous()
    q1, s1, z1, d1 = quantize(w1, case)
    q2, s2, z2, d2 = quantize(w2, case)
    args = (p.x, q1, q2, p.topk_weights, p.topk_ids)
    quant = dict(w1_scale=s1, w2_scale=s2, w1_zp=z1, w2_zp=z2, activation=case.activation, **layer)
    if kernel is None:
        out = tmoe.fused_experts(*args, quant_config=case.config, **quant)
    else:
        out = kernel(*args, **quant)
    return out, moe_reference(p.x, d1, d2, p.topk_weights, p.topk_ids, activation=case.activation, **layer)


# K and N are not multiples of the tiles (block_n 64, block_k = the group), and K not of the group
CASES = [
    Case("int4", 32, True, MoEShape(5, 4, 48, 80, 2), torch.float32),
    Case("int4", 64, False, MoEShape(7, 4, 40, 136, 2), torch.bfloat16, "out_of_range"),
    Case("int4", 128, True, MoEShape(3, 3, 64, 160, 1), torch.float32),
    Case("int8", 32, True, MoEShape(6, 4, 48, 80, 2), torch.bfloat16),
    Case("int8", 128, False, MoEShape(4, 4, 40, 200, 2), torch.float32, "out_of_range"),
    Case("int8", 64, True, MoEShape(0, 4, 64, 64, 2), torch.float32),
    Case("mxfp4", 32, False, MoEShape(5, 4, 48, 96, 2), torch.float32),
    Case("mxfp4", 32, False, MoEShape(9, 4, 64, 80, 3), torch.bfloat16, "skewed"),
    Case("int4", 128, False, MoEShape(6, 4, 48, 200, 2), torch.bfloat16),
    Case("int8", 64, False, MoEShape(5, 3, 40, 136, 2), torch.float16, "out_of_range"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_low_bit_layer(case, route):
    out, ref = run_case(case)
    assert out.dtype == case.dtype
    assert_close(out, ref, case.dtype)


# block_k = the group times groups_per_step; K is mostly not a multiple of block_k
ONE_GROUP = [
    Case("int4", 32, True, MoEShape(5, 4, 48, 80, 2), torch.bfloat16),
    Case("int4", 32, False, MoEShape(7, 4, 40, 136, 2), torch.float16, "out_of_range"),
    Case("int4", 64, True, MoEShape(3, 3, 64, 160, 1), torch.float32),
    Case("int8", 32, True, MoEShape(6, 4, 48, 80, 2), torch.bfloat16),
    Case("mxfp4", 32, False, MoEShape(5, 4, 48, 96, 2), torch.bfloat16),
    Case("mxfp4", 32, False, MoEShape(9, 4, 64, 80, 3), torch.float32, "skewed"),
]
STEP_CASES = [(case, groups) for case in ONE_GROUP for groups in (1, 2)] + [
    (Case("int4", 32, True, MoEShape(5, 4, 48, 80, 2), torch.float32), 4),
    (Case("int8", 32, False, MoEShape(6, 4, 40, 72, 2), torch.bfloat16), 2),
]


@pytest.mark.parametrize("case,groups_per_step", STEP_CASES, ids=lambda v: str(v))
def test_low_bit_k_steps(case, groups_per_step, fp8_matrix_route):
    """One group per K step: bf16/fp16 4-bit steps build the values in the activation dtype (int4
    with the OFFSET row-sum correction), the others in float32. Several: each value is scaled
    before the dot. The last step's packed rows and groups past K are masked. On the aligned and
    decode paths (the fused kernel's K steps: ``test_low_bit_fused_decode_steps``)."""
    tiles = tmoe.GemmConfig(16, 32, case.group * groups_per_step, num_stages=2)
    with tmoe.override_config(tmoe.MoEConfig(tiles, tiles, tiles)):
        out, ref = run_case(case)
    assert_close(out, ref, case.dtype)


@pytest.mark.parametrize("case,groups_per_step,block_n",
                         [(c, g, bn) for c in ONE_GROUP for g, bn in ((1, 32), (2, 64))], ids=lambda v: str(v))
def test_low_bit_fused_decode_steps(case, groups_per_step, block_n):
    """The fused decode kernel's two dequantized GEMMs: the up GEMM's K steps over one group or
    several, and the down GEMM's one K step per program, its block_n intermediate columns inside
    one group (32) or over two groups of 32 (64); N and K not multiples of the tiles."""
    tiles = tmoe.GemmConfig(16, block_n, case.group * groups_per_step, num_stages=2)
    with tmoe.override_config(tmoe.MoEConfig(tiles, tiles)), tmoe.override_route("fused"):
        out, ref = run_case(case)
    assert_close(out, ref, case.dtype)


# each dequant branch with swap_ab: one group per K step (bf16 values from the bits, the int4
# row-sum correction; float32 values), several groups per step (values scaled before the dot)
SWAP_CASES = [
    (Case("int4", 32, True, MoEShape(5, 4, 80, 80, 2), torch.bfloat16), 1),
    (Case("int4", 32, False, MoEShape(7, 4, 72, 136, 2), torch.float32, "out_of_range"), 2),
    (Case("int4", 64, False, MoEShape(6, 4, 64, 160, 1), torch.bfloat16), 2),
    (Case("int8", 32, True, MoEShape(6, 4, 80, 80, 2), torch.float32), 1),
    (Case("int8", 32, False, MoEShape(6, 4, 72, 72, 2), torch.bfloat16), 2),
    (Case("mxfp4", 32, False, MoEShape(5, 4, 64, 96, 2), torch.bfloat16), 1),
    (Case("mxfp4", 32, False, MoEShape(9, 4, 64, 80, 3), torch.float32, "skewed"), 1),
]


@pytest.mark.parametrize("layout", ["sorted", "direct", "batched"])
@pytest.mark.parametrize("case,groups_per_step", SWAP_CASES, ids=lambda v: str(v))
def test_low_bit_swap_ab(case, groups_per_step, layout):
    """``GemmConfig.swap_ab``: the dequantized weights as the dot's LHS, scales and zero points
    per row of the transposed [BN, BM] tile; N and K not multiples of the tiles."""
    tiles = tmoe.GemmConfig(16, 64, case.group * groups_per_step, num_stages=2, swap_ab=True)
    kernel = None
    if layout == "batched":
        slots = case.shape.m * case.shape.topk
        kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(slots, case.shape.e),
                                            tmoe.BatchedTritonExperts(slots, case.config))
    with tmoe.override_config(tmoe.MoEConfig(tiles, tiles)), tmoe.override_route(
            "sorted" if layout == "batched" else layout):
        out, ref = run_case(case, kernel)
    assert_close(out, ref, case.dtype)


@pytest.mark.parametrize("zero_point", [True, False], ids=["zp", "nozp"])
def test_shipped_int8_swap_tiles(zero_point, shipped_swap_tiles):
    """Every swap_ab tile shape the shipped int8 tables name (block_m 32/64, block_k 64/128, group
    128) matches the reference on the sorted route."""
    configs = shipped_swap_tiles("*int8_w8a16*")
    assert configs, "the shipped int8 tables name swap_ab tiles"
    case = Case("int8", 128, zero_point, MoEShape(40, 4, 128, 256, 2), torch.bfloat16, "skewed")
    for cfg in configs:
        with tmoe.override_config(cfg), tmoe.override_route("sorted"):
            out, ref = run_case(case)
        assert_close(out, ref, case.dtype, name=str(cfg))


@pytest.mark.parametrize("scheme", ["int4", "int8", "mxfp4"])
def test_low_bit_expert_map(scheme, route):
    """Global E=8, the even experts local: remote and out-of-range slots contribute exactly zero."""
    case = Case(scheme, 32, scheme != "mxfp4", MoEShape(11, 8, 48, 64, 2), torch.float32, "out_of_range")
    emap = half_remote_expert_map(8, DEVICE)
    out, ref = run_case(case, global_num_experts=8, expert_map=emap)
    assert_close(out, ref, torch.float32)
    ids = make_problem(case.shape, case.dtype, case.routing, seed=case.shape.m + case.group, device=DEVICE).topk_ids
    all_remote = ~((ids >= 0) & (ids < 8) & (ids % 2 == 0)).any(-1)
    assert bool(all_remote.any()) and bool((out[all_remote] == 0).all()), "remote-only tokens must be exactly zero"


# non-gated activations: w1 (E, N, K / p) low-bit codes, its zero points (int4) two rows per byte
NO_MUL_CASES = [
    Case("int4", 32, True, MoEShape(5, 4, 48, 80, 2), torch.bfloat16, activation="relu2_no_mul"),
    Case("int8", 64, False, MoEShape(7, 4, 40, 136, 2), torch.float32, "out_of_range", activation="silu_no_mul"),
    Case("mxfp4", 32, False, MoEShape(9, 4, 64, 80, 3), torch.float16, "skewed", activation="gelu_no_mul"),
]


@pytest.mark.parametrize("case", NO_MUL_CASES, ids=str)
def test_low_bit_no_mul(case, route):
    out, ref = run_case(case)
    assert_close(out, ref, case.dtype)


@pytest.mark.parametrize("scheme", ["int4", "int8", "mxfp4"])
def test_low_bit_gpt_oss_options(scheme, route):
    """GPT-OSS's layer options on low-bit weights: swigluoai with its alpha and limit as runtime
    floats, gate and up rows interleaved, both biases."""
    case = Case(scheme, 32, scheme != "mxfp4", MoEShape(6, 4, 48, 64, 2), torch.bfloat16, "out_of_range",
                activation="swigluoai")
    biases = dict(w1_bias=torch.randn(4, 96, device=DEVICE).to(case.dtype),
                  w2_bias=torch.randn(4, 64, device=DEVICE).to(case.dtype))
    out, ref = run_case(case, swiglu_alpha=1.3, swiglu_limit=0.5, gate_up_interleaved=True, **biases)
    assert_close(out, ref, case.dtype)


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[7], NO_MUL_CASES[0]], ids=str)
def test_low_bit_batched(case):
    m, e, topk = case.shape.m, case.shape.e, case.shape.topk
    kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(m * topk, e),
                                        tmoe.BatchedTritonExperts(m * topk, case.config))
    out, ref = run_case(case, kernel)
    assert_close(out, ref, case.dtype)


@pytest.mark.parametrize("scheme", ["int4", "int8", "mxfp4"])
def test_low_bit_batched_expert_map(scheme):
    """Batched format, global E=8 with the even experts local (4 batches), int with zero points."""
    case = Case(scheme, 32, scheme != "mxfp4", MoEShape(9, 8, 48, 64, 2), torch.float32, "out_of_range")
    emap = half_remote_expert_map(8, DEVICE)
    kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(18, 4), tmoe.BatchedTritonExperts(18, case.config))
    out, ref = run_case(case, kernel, global_num_experts=8, expert_map=emap)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("scheme", ["int4", "int8", "mxfp4"])
def test_low_bit_compiles_once(scheme):
    """fullgraph + dynamic: one graph over M for each scheme (int with zero points), equal to eager."""
    case = Case(scheme, 32, scheme != "mxfp4", MoEShape(1, 4, 48, 64, 4), torch.float32)
    p = make_problem(MoEShape(8, 4, 48, 64, 4), torch.float32, "uniform", seed=3, device=DEVICE)
    q1, s1, z1, _ = quantize(p.w1, case)
    q2, s2, z2, _ = quantize(p.w2, case)

    def layer(x, weights, ids):
        return tmoe.fused_experts(x, q1, q2, weights, ids, quant_config=case.config, w1_scale=s1, w2_scale=s2,
                                  w1_zp=z1, w2_zp=z2)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for m in (3, 9):
        x = torch.randn(m, 64, device=DEVICE)
        weights, ids = torch.topk(torch.randn(m, 4, device=DEVICE).softmax(-1), 4)
        ids = ids.to(torch.int32)
        assert rel_error(compiled(x, weights, ids), layer(x, weights, ids)) == 0.0
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_int4_packing_is_bit_exact():
    """The quantizers' packer equals the reference packer bit for bit, and unpacking inverts it."""
    codes = torch.randint(0, 16, (3, 6, 40), dtype=torch.uint8)
    packed = _pack_nibbles(codes)
    assert torch.equal(packed, pack_int4_reference(codes))
    assert torch.equal(unpack_int4_reference(packed), codes)
    assert torch.equal(packed[..., 0] & 0xF, codes[..., 0]) and torch.equal(packed[..., 0] >> 4, codes[..., 1])


@pytest.mark.parametrize("scheme,zero_point", [("int4", True), ("int4", False), ("int8", True), ("int8", False)])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int_quantizer_rounds_to_nearest(scheme, zero_point, group):
    """Each dequantized value is within one step (the group's scale) of the weight, half a step on
    average over the tensor as rounding to nearest gives (a value at the clipped end of the range,
    after the zero point's or the bf16 scale's rounding, may be a full step off)."""
    bits = 4 if scheme == "int4" else 8
    w = torch.randn(2, 6, 200, dtype=torch.bfloat16)
    quantizer = tmoe.quantize_weight_int4 if bits == 4 else tmoe.quantize_weight_int8
    q, s, zp = quantizer(w, group, zero_point=zero_point)
    groups = -(-200 // group)
    assert q.shape == (2, 6, 200 // (8 // bits)) and s.shape == (2, 6, groups) and s.dtype == torch.bfloat16
    assert zp is None if not zero_point else zp.shape == (2, 6 // (8 // bits), groups)
    d = dequantize_int_reference(q, s, zp, group, bits)
    step = s.float().repeat_interleave(group, -1)[..., :200]
    err = (d - w.float()).abs() / step
    assert float(err.max()) <= 1.0 + 1e-3 and float(err.mean()) < 0.3, (float(err.max()), float(err.mean()))


def test_mxfp4_reference_matches_transformers():
    """The mxfp4 reference dequantizer equals transformers' GPT-OSS one bit for bit on every code
    and a range of exponents, and the quantizer picks the nearest e2m1 value of each block."""
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    blocks = torch.arange(256, dtype=torch.uint8).repeat(2, 4, 1).view(2, 4, 16, 16)  # every byte
    scales = torch.randint(100, 150, (2, 4, 16), dtype=torch.uint8)
    q, s = tmoe.mxfp4_from_blocks(blocks, scales)
    assert q.data_ptr() == blocks.data_ptr() and q.shape == (2, 4, 256)
    ours = dequantize_mxfp4_reference(q, s)
    theirs = convert(blocks, scales, dtype=torch.float32).transpose(1, 2)  # they return (E, K, rows)
    assert torch.equal(ours, theirs)
    w = torch.randn(2, 4, 96)
    q, s = tmoe.quantize_weight_mxfp4(w)
    d = dequantize_mxfp4_reference(q, s)
    scale = torch.exp2(s.float() - 127).repeat_interleave(32, -1)  # e2m1 steps are <= 2 * scale
    assert bool(((d - w).abs() <= scale).all())
    assert bool((w.abs().unflatten(-1, (-1, 32)).amax(-1) > 3 * torch.exp2(s.float() - 127)).all())  # no lazy scale


@pytest.mark.gpu
@pytest.mark.large_memory  # up to 23 GB (mxfp4)
@pytest.mark.parametrize("scheme", ["int4", "int8", "mxfp4"])
def test_low_bit_model_shapes_and_graph_replay(scheme):
    """Qwen3-30B-A3B shape on the H200: every M on every route against the reference, and on every
    route a CUDA graph replayed on new routing equal to eager bit for bit."""
    from tmoe.testing import capture_cuda_graph

    e, n, k, topk = 128, 768, 2048, 8
    case = Case(scheme, 128 if scheme != "mxfp4" else 32, scheme == "int4", MoEShape(1, e, n, k, topk),
                torch.bfloat16)
    w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    w2 = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) / n**0.5
    q1, s1, z1, d1 = quantize(w1, case)
    q2, s2, z2, d2 = quantize(w2, case)
    kernel = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(case.config))
    opts = dict(w1_scale=s1, w2_scale=s2, w1_zp=z1, w2_zp=z2)
    for m in (1, 8, 64, 256, 1024):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
        for route in ROUTES:
            with tmoe.override_route(route):
                out = kernel(x, q1, q2, weights, ids.int(), **opts)
            assert_close(out, moe_reference(x, d1, d2, weights, ids), torch.bfloat16, name=f"M={m} {route}")
    m = 16
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
    ids = ids.int()
    for route in ROUTES:
        with tmoe.override_route(route):
            kernel.warmup(m, q1, q2, topk, **opts)
            graph, out = capture_cuda_graph(lambda: kernel(x, q1, q2, weights, ids, **opts))
            for _ in range(3):
                x.copy_(torch.randn_like(x))
                new_w, new_ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
                weights.copy_(new_w)
                ids.copy_(new_ids)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, kernel(x, q1, q2, weights, ids, **opts)), route


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_asm_unpack_every_code(scheme, dtype, monkeypatch):
    """sm_90: the PTX unpacking (``dequant.packed_values``, and the scaled ``scaled_int4_values`` /
    ``scaled_e2m1_values`` of multi-group K steps) on random bytes (all 256 occur in every expert;
    int4 with random zero points) in both 16-bit activation dtypes, on forced tiles that take it,
    against the reference on the dequantized weights, and bit-identical to the int32 path: any
    wrong code value, zero point, scale or lane order fails."""
    from tmoe.kernels import gemm_args
    from tmoe.kernels.gemm_args import asm_unpack
    from tmoe.kernels.operands import WeightScales
    from tmoe.runtime.state import clear_launch_caches

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the PTX unpacking needs sm_90")
    e, n, k, topk, group = 4, 192, 512, 2, 32
    g = torch.Generator(device="cuda").manual_seed(3)
    codes = lambda rows, cols: torch.randint(0, 256, (e, rows, cols // 2), device="cuda", generator=g,  # noqa: E731
                                             dtype=torch.uint8)
    q1, q2 = codes(2 * n, k), codes(k, n)
    z1 = z2 = None
    if scheme == "int4":
        s1 = torch.rand(e, 2 * n, k // group, device="cuda", generator=g).to(dtype) / (8 * k**0.5)
        s2 = torch.rand(e, k, n // group, device="cuda", generator=g).to(dtype) / (8 * n**0.5)
        z1 = torch.randint(0, 256, (e, n, k // group), device="cuda", generator=g, dtype=torch.uint8)
        z2 = torch.randint(0, 256, (e, k // 2, n // group), device="cuda", generator=g, dtype=torch.uint8)
        d1, d2 = (dequantize_int_reference(q, s, z, group, 4) for q, s, z in ((q1, s1, z1), (q2, s2, z2)))
    else:
        s1 = torch.randint(120, 124, (e, 2 * n, k // group), device="cuda", generator=g, dtype=torch.uint8)
        s2 = torch.randint(120, 124, (e, k, n // group), device="cuda", generator=g, dtype=torch.uint8)
        d1, d2 = (dequantize_mxfp4_reference(q, s) for q, s in ((q1, s1), (q2, s2)))
    x = torch.randn(64, k, device="cuda", dtype=dtype)
    cfg = tmoe.FusedMoEQuantConfig(weight_dtype=scheme, group_size=group)
    real = gemm_args.asm_unpack
    for block_k in (group, 4 * group):  # one group per K step; four (scales, zero points in the PTX)
        tiles = tmoe.GemmConfig(16, 64, block_k, num_warps=4, num_stages=2)
        assert asm_unpack(WeightScales(scheme, s1, z1, group), x, tiles, tiles.block_n)
        for m in (1, 64):
            weights, ids = torch.topk(torch.randn(m, e, device="cuda", generator=g).softmax(-1), topk)
            for route in ("sorted", "direct"):
                outs = []
                for unpack in (real, lambda *args: False):  # the PTX, then the int32 path
                    monkeypatch.setattr(gemm_args, "asm_unpack", unpack)
                    clear_launch_caches()
                    with tmoe.override_config(tmoe.MoEConfig(tiles, tiles, tiles)), tmoe.override_route(route):
                        outs.append(tmoe.fused_experts(x[:m], q1, q2, weights, ids, quant_config=cfg, w1_scale=s1,
                                                       w2_scale=s2, w1_zp=z1, w2_zp=z2))
                name = f"{scheme} {dtype} block_k={block_k} M={m} {route}"
                assert_close(outs[0], moe_reference(x[:m], d1, d2, weights, ids), dtype, name=name)
                assert torch.equal(outs[0], outs[1]), f"{name}: the PTX and int32 paths differ"
    clear_launch_caches()


def _gpt_oss_checkpoint(e: int, h: int, i: int):
    """Random mxfp4 experts in transformers' GPT-OSS checkpoint layout: gate_up blocks
    (E, 2I, H / 32, 16), scales (E, 2I, H / 32), down (E, H, I / 32, 16) and (E, H, I / 32),
    gate and up rows interleaved; float32 biases."""
    g = torch.Generator().manual_seed(11)
    blocks = lambda rows, k: torch.randint(0, 256, (e, rows, k // 32, 16), generator=g, dtype=torch.uint8)  # noqa: E731
    scales = lambda rows, k: torch.randint(119, 124, (e, rows, k // 32), generator=g, dtype=torch.uint8)  # noqa: E731
    return dict(gate_up_proj_blocks=blocks(2 * i, h), gate_up_proj_scales=scales(2 * i, h),
                down_proj_blocks=blocks(h, i), down_proj_scales=scales(h, i),
                gate_up_proj_bias=torch.randn(e, 2 * i, generator=g) * 0.1, down_proj_bias=torch.randn(e, h, generator=g))


class _Swizzled:
    """Stand-in for a triton_kernels tensor as transformers' GPT-OSS loader leaves it: ``storage.data``
    holds the (..., cols, rows) transpose; this layout's ``unswizzle_data`` is the identity."""

    def __init__(self, t: torch.Tensor) -> None:
        identity = type("Layout", (), {"unswizzle_data": staticmethod(lambda d: d)})()
        self.storage = type("Storage", (), {"data": t.transpose(-1, -2), "layout": identity})()


@pytest.mark.parametrize("state", ["checkpoint", "swizzled"])
def test_gpt_oss_mxfp4_experts_stay_packed(state):
    """transformers' Mxfp4GptOssExperts cannot load real weights on CPU (its loader swizzles them
    with triton_kernels on a GPU), so the module gets synthetic tensors in each layout it can
    hold: the checkpoint's blocks (the experts swapped alone), and stand-ins for the swizzled
    triton_kernels tensors inside transformers' Mxfp4GptOssMLP (the block swapped around its
    router). The swap keeps them packed (down_proj a view of the blocks) and matches stock
    GptOssExperts on transformers' own dequantization of the same blocks."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts, Mxfp4GptOssMLP, convert_moe_packed_tensors
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    from tmoe.integrations.transformers import TmoeExperts, TmoeMxfp4GptOssMLP, replace_moe_blocks

    e, h, i, t, k = 4, 64, 96, 7, 2
    config = transformers.GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e,
                                       num_experts_per_tok=k)
    ckpt = {name: t.to(DEVICE) for name, t in _gpt_oss_checkpoint(e, h, i).items()}
    stock = GptOssExperts(config).to(DEVICE)
    with torch.no_grad():
        for proj in ("gate_up_proj", "down_proj"):
            dense = convert_moe_packed_tensors(ckpt[f"{proj}_blocks"], ckpt[f"{proj}_scales"], dtype=torch.float32)
            getattr(stock, proj).copy_(dense)  # (E, H, 2I) and (E, I, H): GPT-OSS's dense layout
            getattr(stock, f"{proj}_bias").copy_(ckpt[f"{proj}_bias"])
    packed = Mxfp4GptOssExperts(config).to(DEVICE)
    with torch.no_grad():
        packed.gate_up_proj_bias.copy_(ckpt["gate_up_proj_bias"])
        packed.down_proj_bias.copy_(ckpt["down_proj_bias"])
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = ckpt[f"{proj}_blocks"], ckpt[f"{proj}_scales"]
        if state == "checkpoint":
            setattr(packed, f"{proj}_blocks", blocks)
            setattr(packed, f"{proj}_scales", scales)
        else:
            del packed._parameters[proj]
            setattr(packed, proj, _Swizzled(blocks.flatten(2)))
            setattr(packed, f"{proj}_precision_config", type("PC", (), {"weight_scale": _Swizzled(scales)})())
    x = torch.randn(t, h, device=DEVICE)
    holder = torch.nn.Module()
    if state == "checkpoint":  # the experts alone (as an expert-parallel hook calls them)
        holder.experts = packed
        assert replace_moe_blocks(holder, strict=True) == 1
        swapped = holder.experts
        assert swapped.down_proj.data_ptr() == ckpt["down_proj_blocks"].data_ptr(), "down_proj must be a view"
        weights, ids = torch.topk(torch.randn(t, e, device=DEVICE).softmax(-1), k)
        with torch.no_grad():  # frozen mxfp4 experts have no backward: a forward autograd records is refused
            out, ref = swapped(x, ids, weights), stock(x, ids, weights)
    else:  # inside the block transformers builds, which routes with triton_kernels: replaced around its router
        router = GptOssTopKRouter(config).to(DEVICE)
        torch.nn.init.normal_(router.weight)
        holder.mlp = Mxfp4GptOssMLP(router, packed)
        assert replace_moe_blocks(holder, strict=True) == 1
        assert isinstance(holder.mlp, TmoeMxfp4GptOssMLP) and holder.mlp.router is router
        swapped = holder.mlp.experts
        with torch.no_grad():  # the router and the biases are trainable parameters
            out, logits = holder.mlp(x.view(1, t, h))
            ref_logits, scores, ids = router(x)
            assert torch.equal(logits, ref_logits)
            out, ref = out.view(t, h), stock(x, ids, scores)
    assert isinstance(swapped, TmoeExperts) and swapped.gate_up_proj.dtype == torch.uint8
    assert swapped.gate_up_proj.shape == (e, 2 * i, h // 2) and swapped.down_proj.shape == (e, h, i // 2)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("quant,group", [("int4", 128), ("mxfp4", 32)])
def test_tune_candidates_cover_both_dequant_paths(quant, group):
    from tmoe.tools.tune import candidates

    for block_m, gated in ((16, True), (64, False)):
        configs = candidates(block_m, gated, quant)
        assert all(not c.tma and c.block_m == block_m for c in configs) and len(set(configs)) == len(configs)
        assert any(c.block_k <= group for c in configs)
    assert any(c.block_k > group for c in candidates(16, True, quant))  # small tiles go up to block_k 256
