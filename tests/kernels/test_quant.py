"""fp8 (e4m3fn) quantization stage against tmoe.reference: fp8 codes compared bit for bit, scales to
rtol 1e-6; edge cases, hypothesis properties, opchecks, bad inputs and the weight helpers."""
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, strategies as st

import tmoe.ops  # noqa: F401  (registers torch.ops.tmoe.*)
from tmoe.kernels.quant import FP8_MAX, per_token_group_quant_fp8, per_token_quant_fp8, static_quant_fp8
from tmoe.weights import (
    quantize_weight_per_block_fp8,
    quantize_weight_per_channel_fp8,
    quantize_weight_per_tensor_fp8,
)
from tmoe.reference import (
    dequantize_fp8_reference,
    per_token_group_quant_fp8_reference,
    per_token_quant_fp8_reference,
    static_quant_fp8_reference,
)
from tmoe.testing import capture_cuda_graph

# Kernel and reference both compute x / scale as IEEE float32 division (tl.div_rn; float64 rounded
# to float32) and cast rounding to nearest even, so no fp8 code may differ. A reciprocal multiply x * (1 / scale) or an
# approximate division would cost up to 1 step on a few codes: FP8_MAX_STEPS bounds that, and
# FP8_MAX_MISMATCHES says how many such codes are tolerated.
FP8_MAX_STEPS = 1
FP8_MAX_MISMATCHES = 0
SCALE_RTOL = 1e-6
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fp8_mismatches(out: torch.Tensor, ref: torch.Tensor) -> tuple[int, int]:
    """(codes that differ, largest difference in fp8 steps) between two float8_e4m3fn tensors.
    NaN must sit where the reference has NaN (any NaN code); +0 and -0 are one value."""
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.float8_e4m3fn
    o, r = out.view(torch.uint8).int().cpu(), ref.view(torch.uint8).int().cpu()
    nan_o, nan_r = (o & 0x7F) == 0x7F, (r & 0x7F) == 0x7F
    assert torch.equal(nan_o, nan_r), f"NaN at {int((nan_o != nan_r).sum())} positions the reference does not have"

    def ordered(bits: torch.Tensor) -> torch.Tensor:
        return torch.where(bits >= 0x80, -(bits & 0x7F), bits)

    steps = (ordered(o) - ordered(r)).abs()[~nan_r]
    return int((steps > 0).sum()), int(steps.max()) if steps.numel() else 0


def assert_fp8_equal(out: torch.Tensor, ref: torch.Tensor, name: str = "q") -> None:
    count, steps = fp8_mismatches(out, ref)
    assert steps <= FP8_MAX_STEPS and count <= FP8_MAX_MISMATCHES, (
        f"{name}: {count} of {ref.numel()} fp8 codes differ from the reference, by up to {steps} steps"
    )


def assert_scales_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref, rtol=SCALE_RTOL, atol=0.0, equal_nan=True)


def make_x(shape: tuple[int, ...], dtype: torch.dtype, device, magnitude: float = 1.0) -> torch.Tensor:
    """Normal values, each row scaled by 10**[-3, 3] so groups and rows differ in range."""
    x = torch.randn(shape, device=device) * magnitude
    if len(shape) > 1:
        x *= 10.0 ** torch.randint(-3, 4, (*shape[:-1], 1), device=device)
    return x.to(dtype)


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]  # x: (..., K)
    group_size: int
    dtype: torch.dtype = torch.bfloat16
    column_major: bool = False
    ue8m0: bool = False


CASES = [
    Case((0, 128), 128),
    Case((1, 128), 128),
    Case((1, 64), 64, torch.float32),
    Case((5, 384), 128),
    Case((7, 384), 64, torch.float16),
    Case((3, 72), 8, torch.float32),
    Case((4, 96), 24),  # group size not a power of two
    Case((256,), 64),  # no leading dims
    Case((2, 3, 256), 128),  # (E, cap, K)
    Case((0, 3, 128), 64),
    Case((9, 256), 128, column_major=True),
    Case((2, 5, 128), 64, torch.float16, column_major=True),
    Case((6, 384), 128, ue8m0=True),
    Case((3, 72), 8, torch.float32, column_major=True, ue8m0=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_group_quant_matches_reference(case: Case, device):
    x = make_x(case.shape, case.dtype, device)
    q, s = per_token_group_quant_fp8(x, case.group_size, column_major_scales=case.column_major, use_ue8m0=case.ue8m0)
    ref_q, ref_s = per_token_group_quant_fp8_reference(x, case.group_size, use_ue8m0=case.ue8m0)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (*x.shape[:-1], x.shape[-1] // case.group_size)
    if case.column_major and s.numel():
        rows = x.numel() // x.shape[-1]
        assert s.reshape(rows, -1).stride() == (1, rows)
    assert_fp8_equal(q, ref_q)
    assert_scales_close(s, ref_s)


def test_group_quant_into_given_outputs(device):
    x = make_x((5, 256), torch.bfloat16, device)
    out_q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
    out_scale = torch.full((2, 5), float("nan"), device=device).t()
    q, s = per_token_group_quant_fp8(x, 128, out_q=out_q, out_scale=out_scale)
    assert q is out_q and s is out_scale
    ref_q, ref_s = per_token_group_quant_fp8_reference(x, 128)
    assert_fp8_equal(q, ref_q)
    assert_scales_close(s, ref_s)


def test_group_quant_strided_rows(device):
    """Rows with a stride larger than K (a slice of a wider tensor) are read in place."""
    wide = make_x((6, 512), torch.float16, device)
    x = wide[:, 128:384]
    q, s = per_token_group_quant_fp8(x, 128)
    ref_q, ref_s = per_token_group_quant_fp8_reference(x, 128)
    assert_fp8_equal(q, ref_q)
    assert_scales_close(s, ref_s)


def test_zero_rows_get_eps_scale(device):
    x = make_x((4, 128), torch.bfloat16, device)
    x[0] = 0
    x[2, :64] = 0
    q, s = per_token_group_quant_fp8(x, 64)
    eps_scale = torch.tensor(1e-10, dtype=torch.float32) / FP8_MAX
    assert torch.equal(s[0].cpu(), eps_scale.expand(2)) and s[2, 0].cpu() == eps_scale
    assert torch.all(q[0].view(torch.uint8) == 0) and torch.all(q[2, :64].view(torch.uint8) == 0)
    assert torch.isfinite(q.float()).all()
    assert_fp8_equal(q, per_token_group_quant_fp8_reference(x, 64)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # float16 cannot hold 1e-23
def test_tiny_inputs(dtype, device):
    """Inputs around 1e-23: with a small eps they use the full fp8 range (scales near 1e-26);
    under the default eps = 1e-10 they quantize to zero."""
    x = (torch.randn(3, 128, device=device) * 1e-23).to(dtype)
    for eps in (1e-30, 1e-10):
        q, s = per_token_group_quant_fp8(x, 64, eps=eps)
        ref_q, ref_s = per_token_group_quant_fp8_reference(x, 64, eps=eps)
        assert_fp8_equal(q, ref_q)
        assert_scales_close(s, ref_s)
    assert torch.all(q.float() == 0)
    q, _ = per_token_group_quant_fp8(x, 64, eps=1e-30)
    assert torch.all(q.float().abs().unflatten(-1, (2, 64)).amax(-1) == FP8_MAX)


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # inf / inf
def test_inf_and_nan_stay_in_their_group(device):
    x = make_x((3, 256), torch.float32, device)
    x[1, 3] = 0.0
    bad = x.clone()
    bad[0, 70] = float("inf")  # row 0, group 1 of 4
    bad[1, 3] = float("nan")  # row 1, group 0: NaN is left out of the absmax
    bad[2, 200] = -float("inf")  # row 2, group 3
    q, s = per_token_group_quant_fp8(bad, 64)
    ref_q, ref_s = per_token_group_quant_fp8_reference(bad, 64)
    assert_fp8_equal(q, ref_q)
    assert_scales_close(s, ref_s)
    clean_q, clean_s = per_token_group_quant_fp8(x, 64)
    inf_groups = torch.zeros(3, 4, dtype=torch.bool, device=device)
    inf_groups[0, 1] = inf_groups[2, 3] = True
    assert torch.isinf(s[inf_groups]).all() and torch.equal(s[~inf_groups], clean_s[~inf_groups])
    assert torch.isnan(q[1, 3].float())
    codes, clean_codes = q.view(torch.uint8).clone(), clean_q.view(torch.uint8)
    codes[1, 3] = clean_codes[1, 3]
    assert torch.equal(codes.view(3, 4, 64)[~inf_groups], clean_codes.view(3, 4, 64)[~inf_groups])


def test_mantissa_carry_rounds_up(device):
    """x / scale = 124.3 must give 128 (a cast that drops the carry gives 64); ties go to even."""
    scale = 2.0**-5  # absmax 448 * scale: the scale is exact
    values = [448.0, 124.3, -124.3, 124.0, 15.9, 0.98, 250.0, 0.0]
    expect = [448.0, 128.0, -128.0, 128.0, 16.0, 1.0, 256.0, 0.0]
    x = torch.tensor(values, device=device).view(1, 8) * scale
    q, s = per_token_group_quant_fp8(x, 8)
    assert s.item() == scale and q.float()[0].tolist() == expect
    assert_fp8_equal(q, per_token_group_quant_fp8_reference(x, 8)[0])
    one = torch.ones(1, device=device)
    static = static_quant_fp8(torch.tensor([[124.3, 460.0, -1000.0, 0.98]], device=device), one)
    assert static.float().tolist() == [[128.0, 448.0, -448.0, 1.0]]


def test_ue8m0_scales_are_the_next_power_of_two(device):
    x = make_x((8, 256), torch.bfloat16, device)
    x[0, :128] = 448.0 * 2.0**-3  # absmax / 448 exactly a power of two: kept, not doubled
    _, s = per_token_group_quant_fp8(x, 128, use_ue8m0=True)
    _, raw = per_token_group_quant_fp8(x, 128)
    mantissa, _ = torch.frexp(s)
    assert torch.all(mantissa == 0.5) and torch.all(s >= raw) and torch.all(s / 2 < raw)
    assert s[0, 0].item() == 2.0**-3


@given(
    shape_group=st.sampled_from([((1, 128), 128), ((3, 256), 64), ((8, 72), 8), ((2, 3, 384), 128), ((5, 192), 64)]),
    dtype=st.sampled_from(DTYPES),
    log2_magnitude=st.integers(-25, 60),  # the absmax stays above eps = 1e-10
    ue8m0=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_group_quant_properties(shape_group, dtype, log2_magnitude, ue8m0, seed):
    """Codes match the reference; each group reaches |q| = 448 ([224, 448] with ue8m0); the
    dequantized value is within half an fp8 step of x."""
    shape, group_size = shape_group
    if dtype == torch.float16:
        log2_magnitude = max(-12, min(log2_magnitude, 12))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    x = (torch.randn(shape, device=device) * 2.0**log2_magnitude).to(dtype)
    q, s = per_token_group_quant_fp8(x, group_size, use_ue8m0=ue8m0)
    ref_q, ref_s = per_token_group_quant_fp8_reference(x, group_size, use_ue8m0=ue8m0)
    assert_fp8_equal(q, ref_q)
    assert_scales_close(s, ref_s)
    peak = q.float().unflatten(-1, (-1, group_size)).abs().amax(-1)
    assert torch.all((peak >= FP8_MAX / 2) & (peak <= FP8_MAX)) if ue8m0 else torch.all(peak == FP8_MAX)
    err = (dequantize_fp8_reference(q, s, (group_size,)) - x.float()).abs()
    bound = 2**-4 * x.float().abs() + 2**-10 * s.repeat_interleave(group_size, -1)
    assert torch.all(err <= bound * (1 + 1e-6))


@pytest.mark.parametrize(
    "shape,dtype", [((0, 64), torch.bfloat16), ((1, 7), torch.float32), ((5, 1000), torch.bfloat16),
                    ((3, 4100), torch.float16), ((2, 3, 72), torch.float32), ((96,), torch.bfloat16),
                    ((2, 20000), torch.bfloat16)], ids=str,  # K > PER_TOKEN_BLOCK_K: two passes over the row
)
def test_per_token_quant_matches_reference(shape, dtype, device):
    x = make_x(shape, dtype, device)
    if x.numel():
        x.view(-1, shape[-1])[0, 1] = float("nan")
        x.view(-1, shape[-1])[-1] = 0
    q, s = per_token_quant_fp8(x)
    ref_q, ref_s = per_token_quant_fp8_reference(x)
    assert q.shape == x.shape and s.shape == (*shape[:-1], 1)
    assert_fp8_equal(q, ref_q)
    assert_scales_close(s, ref_s)


@pytest.mark.parametrize("limit", [0, 3, 7, 9])
def test_num_rows_quantizes_only_the_rows_below_it(limit, device):
    """With ``num_rows`` (read on the device) each quantizer writes exactly the rows below it, equal
    to the unlimited call's, and leaves the rest as allocated (poisoned: NaN codes and scales)."""
    x = make_x((7, 256), torch.bfloat16, device)
    num_rows = torch.tensor([limit], dtype=torch.int32, device=device)
    scale = torch.full((1,), 0.05, device=device)
    calls = {"per_token": lambda **kw: per_token_quant_fp8(x, **kw),
             "group": lambda **kw: per_token_group_quant_fp8(x, 64, **kw),
             "static": lambda **kw: (static_quant_fp8(x, scale, **kw), None)}
    written = min(limit, x.shape[0])
    for name, call in calls.items():
        (q, s), (ref_q, ref_s) = call(num_rows=num_rows), call()
        assert_fp8_equal(q[:written], ref_q[:written], name)
        assert q[written:].float().isnan().all(), name
        if s is not None:
            assert_scales_close(s[:written], ref_s[:written])
            assert s[written:].isnan().all(), name


@pytest.mark.parametrize("shape,scale_shape", [((0, 16), (1,)), ((1, 7), ()), ((4, 3, 100), (1,)), ((2, 2000), ())],
                         ids=str)
def test_static_quant_matches_reference(shape, scale_shape, device):
    x = make_x(shape, torch.bfloat16, device)
    if x.numel():
        x.view(-1, shape[-1])[0, :3] = torch.tensor([float("nan"), 1e6, -1e6])
    scale = torch.full(scale_shape, 0.05, device=device)
    q = static_quant_fp8(x, scale)
    assert q.shape == x.shape
    assert_fp8_equal(q, static_quant_fp8_reference(x, scale))


@pytest.mark.parametrize("column_major,ue8m0", [(False, False), (True, True)])
def test_opcheck_group_quant(column_major, ue8m0, device):
    x = make_x((4, 128), torch.bfloat16, device)
    torch.library.opcheck(torch.ops.tmoe.per_token_group_quant_fp8.default, (x, 64, 1e-10, column_major, ue8m0))


def test_opcheck_per_token_and_static(device):
    x = make_x((3, 40), torch.float16, device)
    torch.library.opcheck(torch.ops.tmoe.per_token_quant_fp8.default, (x, 1e-10))
    torch.library.opcheck(torch.ops.tmoe.static_quant_fp8.default, (x, torch.tensor([0.1], device=device)))


FP8 = torch.float8_e4m3fn
BAD_CALLS = {
    "int32 x": (TypeError, lambda x: per_token_group_quant_fp8(x.to(torch.int32), 64)),
    "float64 x": (TypeError, lambda x: per_token_group_quant_fp8(x.double(), 64)),
    "K % group_size": (ValueError, lambda x: per_token_group_quant_fp8(x, 48)),
    "group_size 0": (ValueError, lambda x: per_token_group_quant_fp8(x, 0)),
    "strided K": (ValueError, lambda x: per_token_group_quant_fp8(x.t().contiguous().t(), 64)),
    "eps 0": (ValueError, lambda x: per_token_group_quant_fp8(x, 64, eps=0.0)),
    "out_q dtype": (TypeError, lambda x: per_token_group_quant_fp8(x, 64, out_q=torch.empty_like(x))),
    "out_q shape": (ValueError, lambda x: per_token_group_quant_fp8(x, 64, out_q=x[:, :64].to(FP8))),
    "out_scale shape": (ValueError, lambda x: per_token_group_quant_fp8(x, 64, out_scale=x[:, :3].contiguous())),
    "out_scale layout": (ValueError, lambda x: per_token_group_quant_fp8(
        x.view(2, 2, 128), 64, out_scale=torch.zeros(2, 2, 2, device=x.device).transpose(0, 1))),
    "per-token int8 x": (TypeError, lambda x: per_token_quant_fp8(x.to(torch.int8))),
    "per-token strided K": (ValueError, lambda x: per_token_quant_fp8(x.t().contiguous().t())),
    "static scale shape": (ValueError, lambda x: static_quant_fp8(x, x[0, :2])),
    "static scale dtype": (TypeError, lambda x: static_quant_fp8(x, x[0, :1].half())),
    "static scale float": (TypeError, lambda x: static_quant_fp8(x, 0.5)),
    "num_rows int64": (TypeError, lambda x: per_token_quant_fp8(x, num_rows=torch.ones(1, dtype=torch.int64,
                                                                                      device=x.device))),
    "num_rows shape": (ValueError, lambda x: per_token_group_quant_fp8(
        x, 64, num_rows=torch.ones(2, dtype=torch.int32, device=x.device))),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_inputs_raise(name, device):
    error, call = BAD_CALLS[name]
    with pytest.raises(error):
        call(torch.randn(4, 128, device=device))


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager(device):
    """The launchers make no host syncs: captured once, replayed on new data in the same buffers."""
    x = make_x((64, 512), torch.bfloat16, device)
    scale = torch.tensor([0.05], device=device)

    def run() -> tuple[torch.Tensor, ...]:
        return (*per_token_group_quant_fp8(x, 128, column_major_scales=True), *per_token_quant_fp8(x),
                static_quant_fp8(x, scale))

    graph, outs = capture_cuda_graph(run)
    x.copy_(make_x((64, 512), torch.bfloat16, device))
    scale.fill_(0.01)
    graph.replay()
    for out, want in zip(outs, run()):
        if out.dtype == torch.float8_e4m3fn:
            assert_fp8_equal(out, want)
        else:
            assert torch.equal(out, want)


def test_weight_per_channel_matches_per_token_reference(device):
    w = make_x((3, 20, 72), torch.bfloat16, device)
    q, s = quantize_weight_per_channel_fp8(w)
    ref_q, ref_s = per_token_quant_fp8_reference(w)
    assert s.shape == (3, 20, 1)
    assert_fp8_equal(q, ref_q)
    assert_scales_close(s, ref_s)


def test_weight_per_block_ragged(device):
    w = make_x((2, 200, 300), torch.float32, device)
    q, s = quantize_weight_per_block_fp8(w, (128, 128))
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn and s.shape == (2, 2, 3)
    assert s[1, 1, 2].item() == pytest.approx(w[1, 128:, 256:].abs().max().item() / FP8_MAX, rel=1e-6)
    err = (dequantize_fp8_reference(q, s, (128, 128)) - w).abs()
    bound = 2**-4 * w.abs() + 2**-10 * s.repeat_interleave(128, 1)[:, :200].repeat_interleave(128, 2)[:, :, :300]
    assert torch.all(err <= bound * (1 + 1e-6))


def test_weight_per_tensor(device):
    w = make_x((3, 16, 64), torch.float16, device)
    w[1] = 0
    q, s = quantize_weight_per_tensor_fp8(w)
    assert s.shape == (3,) and s[1].item() == pytest.approx(1e-10 / FP8_MAX)
    assert torch.all(q.float().abs().flatten(1).amax(1)[[0, 2]] == FP8_MAX)
    err = (dequantize_fp8_reference(q, s.view(3, 1, 1)) - w.float()).abs()
    assert torch.all(err <= (2**-4 * w.float().abs() + 2**-10 * s.view(3, 1, 1)) * (1 + 1e-6))
