"""The composed layer (tmoe.fused_experts) against tmoe.reference.moe_reference."""
from dataclasses import dataclass

import zlib

import pytest
import torch
from hypothesis import given

import tmoe
from tmoe.reference import moe_reference
from tmoe.kernels.activation import Activation
from tmoe.modular import Route
from tmoe.modular.problem import MoEProblem
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, half_remote_expert_map, make_problem, problems, route_shape

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Case:
    shape: MoEShape
    routing: str = "uniform"
    activation: str = "silu"


CASES = [
    Case(MoEShape(0, 4, 64, 64, 2)),
    Case(MoEShape(1, 4, 64, 64, 2)),
    Case(MoEShape(1, 1, 64, 64, 1)),  # E = 1
    Case(MoEShape(5, 4, 100, 72, 2)),  # odd N and K
    Case(MoEShape(9, 4, 64, 64, 4)),  # topk = E
    Case(MoEShape(12, 8, 64, 64, 1)),  # topk = 1
    Case(MoEShape(16, 8, 64, 64, 2), "empty_experts"),
    Case(MoEShape(16, 8, 64, 64, 2), "one_hot"),  # all tokens on the same experts
    Case(MoEShape(40, 8, 64, 64, 2), "skewed"),
    Case(MoEShape(17, 4, 64, 64, 2), "out_of_range"),
    Case(MoEShape(70, 4, 64, 72, 2), "uniform"),  # several row blocks per expert
    Case(MoEShape(6, 4, 100, 64, 2), "uniform", "gelu"),
    Case(MoEShape(6, 4, 64, 64, 2), "uniform", "gelu_tanh"),
    Case(MoEShape(6, 4, 64, 64, 2), "uniform", "swigluoai"),
]


def run_and_check(p, dtype, **kwargs):
    out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **kwargs)
    ref_kwargs = {k: v for k, v in kwargs.items() if k in ("activation", "apply_router_weight_on_input",
                                                             "expert_map", "global_num_experts")}
    ref = moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **ref_kwargs)
    assert out.dtype == p.x.dtype
    assert_close(out, ref, dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_experts_cases(case, dtype, matrix_route):
    p = make_problem(route_shape(case.shape, matrix_route), dtype, case.routing, seed=zlib.crc32(str(case).encode()) % 1000, device=DEVICE)
    run_and_check(p, dtype, activation=case.activation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [c for c in CASES if c.shape.m <= 17], ids=str)
def test_slots_route_cases(case, dtype):
    """The slots path (the default at M=1) on the small-M cases: M=0 and 1, E=1, odd N and K,
    topk=E and 1, empty experts, one-hot and out-of-range routing, every activation."""
    p = make_problem(case.shape, dtype, case.routing, seed=zlib.crc32(str(case).encode()) % 1000, device=DEVICE)
    with tmoe.override_route("slots"):
        run_and_check(p, dtype, activation=case.activation)


@given(problems(device=DEVICE))
def test_fused_experts_property(p):
    run_and_check(p, p.x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_map_half_remote(dtype, route):
    """Global E=8, this rank holds the 4 even experts: remote slots contribute exactly zero."""
    shape = MoEShape(23, 8, 64, 64, 2)
    p = make_problem(shape, dtype, "out_of_range", seed=3, device=DEVICE)
    emap = half_remote_expert_map(8, DEVICE)
    local = torch.arange(8, device=DEVICE)[emap >= 0]
    w1, w2 = p.w1[local].contiguous(), p.w2[local].contiguous()
    out = tmoe.fused_experts(p.x, w1, w2, p.topk_weights, p.topk_ids, global_num_experts=8, expert_map=emap)
    ref = moe_reference(p.x, w1, w2, p.topk_weights, p.topk_ids, expert_map=emap, global_num_experts=8)
    assert_close(out, ref, dtype)
    all_remote = ~((p.topk_ids >= 0) & (p.topk_ids < 8) & (p.topk_ids % 2 == 0)).any(-1)
    assert bool((out[all_remote] == 0).all()), "tokens routed only to remote experts must be exactly zero"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_router_weight_on_input(dtype, route):
    p = make_problem(MoEShape(19, 4, 64, 64, 1), dtype, "uniform", seed=5, device=DEVICE)
    weights = torch.rand_like(p.topk_weights) + 0.5
    out = tmoe.fused_experts(p.x, p.w1, p.w2, weights, p.topk_ids, apply_router_weight_on_input=True)
    ref = moe_reference(p.x, p.w1, p.w2, weights, p.topk_ids, apply_router_weight_on_input=True)
    assert_close(out, ref, dtype)


def test_inplace_writes_into_hidden_states():
    p = make_problem(MoEShape(13, 4, 64, 64, 2), torch.float32, "uniform", seed=7, device=DEVICE)
    ref = moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    x = p.x.clone()
    out = tmoe.fused_experts(x, p.w1, p.w2, p.topk_weights, p.topk_ids, inplace=True)
    assert out.data_ptr() == x.data_ptr()
    assert_close(x, ref, torch.float32)


def test_forced_tile_configs():
    """Tiny and wide tiles give the same function (masking, EVEN_K=False, several N blocks)."""
    p = make_problem(MoEShape(21, 4, 100, 72, 2), torch.float32, "skewed", seed=11, device=DEVICE)
    ref = moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    for bm, bn, bk in [(16, 16, 16), (32, 128, 64), (64, 32, 128)]:
        cfg = tmoe.MoEConfig(tmoe.GemmConfig(bm, bn, bk, group_m=2), tmoe.GemmConfig(bm, bn, bk, group_m=1))
        with tmoe.override_config(cfg):
            out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
        assert_close(out, ref, torch.float32, name=f"out[{bm}x{bn}x{bk}]")


def _args(**over):
    p = make_problem(MoEShape(4, 4, 64, 64, 2), torch.float32, "uniform", seed=0, device=DEVICE)
    args = dict(hidden_states=p.x, w1=p.w1, w2=p.w2, topk_weights=p.topk_weights, topk_ids=p.topk_ids)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, kwargs, error, match",
    [  # the bad arguments made on DEVICE when the test runs, so only the named fault is wrong
        (lambda: dict(hidden_states=torch.randn(4, 60)), {}, ValueError, "K"),
        (lambda: dict(hidden_states=torch.randn(4, 64, dtype=torch.float64)), {}, TypeError, "hidden_states"),
        (lambda: dict(w1=torch.randn(4, 127, 64)), {}, ValueError, "w1"),
        (lambda: dict(w2=torch.randn(4, 64, 60)), {}, ValueError, "w2"),
        (lambda: dict(topk_ids=torch.zeros(4, 2)), {}, TypeError, "topk_ids"),
        (lambda: dict(topk_ids=torch.zeros(5, 2, dtype=torch.int32)), {}, ValueError, "topk_ids"),
        (lambda: dict(topk_weights=torch.ones(4, 2, dtype=torch.float64)), {}, TypeError, "topk_weights"),  # bf16 is cast
        (lambda: dict(topk_weights=torch.ones(4, 3)), {}, ValueError, "topk_weights"),
        (lambda: dict(topk_ids=torch.zeros(4, 4, dtype=torch.int32)[:, ::2]), {}, ValueError, "topk_ids"),
        (dict, dict(activation="relu"), ValueError, "activation"),
        (dict, dict(apply_router_weight_on_input=True), ValueError, "topk == 1"),
        (dict, dict(global_num_experts=8), ValueError, "expert_map"),
    ],
)
def test_bad_input_raises_before_launch(over, kwargs, error, match):
    with torch.device(DEVICE):
        over = over()
    with pytest.raises(error, match=match):
        tmoe.fused_experts(**_args(**over), **kwargs)


@pytest.mark.parametrize("fmt", ["standard", "batched"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_biases_with_swigluoai(dtype, fmt, route):
    """GPT-OSS-style experts: biases before the activation and before the router weight."""
    p = make_problem(MoEShape(11, 4, 64, 72, 2), dtype, "out_of_range", seed=17, device=DEVICE)
    b1 = torch.randn(4, 128, device=DEVICE).to(dtype)
    b2 = torch.randn(4, 72, device=DEVICE).to(dtype)
    kwargs = dict(activation="swigluoai", w1_bias=b1, w2_bias=b2)
    if fmt == "standard":
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **kwargs)
    else:
        kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(22, 4), tmoe.BatchedTritonExperts(22))
        out = kernel(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **kwargs)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **kwargs), dtype)


def test_direct_route_runs_no_align_and_no_reduce(monkeypatch):
    """The decode path launches neither the align stage nor the reduce: the down GEMM writes
    the weighted sum straight into the layer output."""
    import tmoe.modular.experts
    import tmoe.modular.prepare_finalize

    def fail(*args, **kwargs):
        raise AssertionError("the decode path must not align or reduce")

    monkeypatch.setattr(tmoe.modular.experts, "moe_align_block_size", fail)
    monkeypatch.setattr(tmoe.modular.prepare_finalize, "moe_reduce", fail)
    p = make_problem(MoEShape(3, 8, 64, 64, 2), torch.float32, "uniform", seed=2, device=DEVICE)
    with tmoe.override_route("direct"):
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), torch.float32)


@pytest.mark.parametrize("m, topk", [(1, 8), (2, 8), (1, 1), (4096, 8)])
def test_route_by_slot_count(m, topk, monkeypatch):
    assert tmoe.config.use_direct_route(m, topk) is (m * topk <= tmoe.config.DIRECT_MAX_SLOTS)
    monkeypatch.setattr(tmoe.config, "DIRECT_MAX_SLOTS", 16)
    assert tmoe.config.use_direct_route(m, topk) is (m * topk <= 16)
    with tmoe.override_route("sorted"):
        assert not tmoe.config.use_direct_route(m, topk)


@pytest.mark.parametrize("m", [1, 2, 4, 5])
def test_fused_route_by_size(m, monkeypatch):
    """The fused decode path by default: unquantized experts of at most FUSED_MAX_EXPERT_ELEMENTS
    weights per GEMM (Qwen3-30B-A3B's 768 x 2048) at 2-4 tokens, where it was measured faster; not
    for larger experts (DeepSeek-V3's 2048 x 7168), low-bit weights or fp8 activations. It writes
    the layer output itself: no align, no top-k reduce."""
    want = 2 <= m <= 4
    assert tmoe.config.use_fused_route(m, 768, 2048) is want
    assert not tmoe.config.use_fused_route(m, 2048, 7168)
    assert not tmoe.config.use_fused_route(m, 768, 2048, low_bit=True)
    with tmoe.override_route("sorted"):
        assert not tmoe.config.use_fused_route(m, 768, 2048)
    with tmoe.override_route("fused"):
        assert tmoe.config.use_fused_route(m, 2048, 7168, low_bit=True)
    fp8 = tmoe.TritonExperts(tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, per_act_token_quant=True))
    # Qwen3-30B-A3B's problem (128 experts, top-8): too few rows per expert for the grouped core,
    # whose operand check is the only reader of the call's tensors (none given here)
    problem = MoEProblem(128, 128, 768, 2048, 8, Activation(), torch.bfloat16, torch.bfloat16)
    assert not fp8.route(problem, m, may_reduce=True, args=None, rows_copied=True).reduces_topk
    route = tmoe.TritonExperts().route(problem, m, may_reduce=True, args=None, rows_copied=False)
    assert route.reduces_topk is want and (route is Route.FUSED) is want
    assert not tmoe.TritonExperts().route(problem, m, may_reduce=False, args=None, rows_copied=False).reduces_topk

    def fail(*args, **kwargs):
        raise AssertionError("the fused decode path must not align or reduce")

    if want:
        monkeypatch.setattr(tmoe.modular.experts, "moe_align_block_size", fail)
        monkeypatch.setattr(tmoe.modular.prepare_finalize, "moe_reduce", fail)
    p = make_problem(MoEShape(m, 8, 64, 96, 2), torch.float32, "uniform", seed=m, device=DEVICE)
    out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), torch.float32)


def test_bad_bias_shape():
    with pytest.raises(ValueError, match="w1_bias"):
        tmoe.fused_experts(**_args(), w1_bias=torch.zeros(4, 64, device=DEVICE))



def run_layout(p, layout: str, **kwargs):
    """tmoe.fused_experts on the "sorted" or "direct" route, or the Batched format ("batched")."""
    if layout == "batched":
        m, topk = p.topk_ids.shape
        kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(m * topk, p.w1.shape[0]),
                                            tmoe.BatchedTritonExperts(m * topk))
        return kernel(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **kwargs)
    with tmoe.override_route(layout):
        return tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **kwargs)


@pytest.mark.parametrize("tiles", [(16, 64, 32, False), (32, 128, 64, True)], ids=["bm16", "bm32-bn128-tma"])
@pytest.mark.parametrize("layout", ["sorted", "direct", "batched"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_ab_tiles(dtype, layout, tiles):
    """``GemmConfig.swap_ab``: tiles computed transposed (weights as the MMA's LHS) give the same
    layer; odd N and K mask rows and columns of the transposed tile; with ``tma`` the launcher
    loads by pointers. The direct route runs its up GEMM at block_m 16; its down GEMM
    (moe_down_reduce) ignores swap_ab."""
    bm, bn, bk, tma = tiles
    p = make_problem(MoEShape(21, 4, 100, 72, 2), dtype, "skewed", seed=23, device=DEVICE)
    swap = tmoe.GemmConfig(bm, bn, bk, tma=tma, swap_ab=True)
    with tmoe.override_config(tmoe.MoEConfig(swap, swap)):
        out = run_layout(p, layout)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), dtype)
