"""Router top-k: fixed cases, exact tie-breaking, NaN logits, a hypothesis property, opcheck, compile."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, strategies as st

import tmoe.ops  # noqa: F401  (registers torch.ops.tmoe.*)
from tmoe.kernels import router
from tmoe.kernels.router import topk_route
from tmoe.reference import topk_route_reference
from tmoe.testing import Tolerance, assert_close, capture_cuda_graph

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# softmax of all -inf rows (all-NaN logits, rows past M) is 0/0 by design in the interpreter's numpy
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# Weights are float32 math on the same upcast logits as the reference: only exp/sigmoid/sum rounding differs.
WEIGHT_TOL = {
    torch.float32: Tolerance(rel=1e-5, atol=1e-6, rtol=1e-5),
    torch.float16: Tolerance(rel=1e-4, atol=1e-5, rtol=1e-4),
    torch.bfloat16: Tolerance(rel=1e-4, atol=1e-5, rtol=1e-4),
}


@dataclass(frozen=True)
class Case:
    name: str
    m: int
    e: int
    topk: int
    scoring: str = "softmax"
    renormalize: bool = True
    groups: tuple[int, int] | None = None  # (num_expert_group, topk_group)
    bias: bool = False
    scale: float = 1.0
    dtype: torch.dtype = torch.float32
    ints: bool = False  # small integer logits (and bias): many exact ties

    def route_kwargs(self, bias: torch.Tensor | None) -> dict:
        g, kept = self.groups or (None, None)
        return dict(scoring=self.scoring, renormalize=self.renormalize, num_expert_group=g, topk_group=kept,
                    e_score_correction_bias=bias, routed_scaling_factor=self.scale)


DSV3 = dict(scoring="sigmoid", groups=(8, 4), bias=True, scale=2.5)
CASES = [
    Case("m0", 0, 8, 2),
    Case("m1", 1, 8, 2),
    Case("e1", 5, 1, 1),
    Case("topk_eq_e", 3, 6, 6),
    Case("mixtral", 37, 8, 2),
    Case("qwen3", 19, 128, 8),
    Case("deepseek_v3", 21, 256, 8, **DSV3),
    Case("odd_e6", 9, 6, 3),
    Case("odd_e60_groups", 11, 60, 4, scoring="sigmoid", groups=(4, 2), bias=True),
    Case("sigmoid_groups_no_bias", 10, 64, 4, scoring="sigmoid", groups=(8, 3)),
    Case("group_size_1", 6, 8, 2, scoring="sigmoid", groups=(8, 4), bias=True),
    Case("no_renorm_softmax", 13, 60, 4, renormalize=False),
    Case("no_renorm_sigmoid", 13, 64, 6, scoring="sigmoid", renormalize=False, bias=True, scale=2.0),
    Case("ties_softmax", 33, 64, 6, ints=True),
    Case("ties_deepseek_v3", 17, 256, 8, ints=True, **DSV3),
    Case("mixtral_bf16", 37, 8, 2, dtype=torch.bfloat16),
    Case("qwen3_fp16", 19, 128, 8, dtype=torch.float16),
    Case("deepseek_v3_bf16", 21, 256, 8, dtype=torch.bfloat16, **DSV3),
]


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    if case.ints:
        logits = torch.randint(-2, 3, (case.m, case.e), generator=gen).float()
        bias = torch.randint(0, 2, (case.e,), generator=gen).float()
    else:
        logits = 2 * torch.randn(case.m, case.e, generator=gen)
        bias = 0.1 * torch.randn(case.e, generator=gen)
    return logits.to(device, case.dtype), bias.to(device) if case.bias else None


def check_route(case: Case, logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    kwargs = case.route_kwargs(bias)
    w, ids = topk_route(logits, case.topk, **kwargs)
    ref_w, ref_ids = topk_route_reference(logits, case.topk, **kwargs)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert ids.shape == w.shape == (case.m, case.topk)
    assert ((ids >= 0) & (ids < case.e)).all(), "out-of-range expert id"
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all(), "an expert picked twice in one row"
    assert torch.equal(ids.cpu(), ref_ids.cpu()), "ids differ from the lowest-index-wins reference"
    assert_close(w, ref_w, WEIGHT_TOL[case.dtype], name="topk_weights")
    return w, ids


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_topk_route(case: Case, device: torch.device) -> None:
    w, _ = check_route(case, *make_inputs(case, device))
    if case.renormalize and case.m:
        torch.testing.assert_close(w.sum(dim=1), torch.full_like(w[:, 0], case.scale), rtol=1e-5, atol=1e-6)


def test_matches_torch_topk_without_ties(device: torch.device) -> None:
    """Random float logits have no ties: the ids are torch.topk of the softmax, in order."""
    logits = torch.randn(50, 128, device=device)
    w, ids = topk_route(logits, 8, renormalize=False)
    ref_w, ref_ids = torch.softmax(logits, dim=-1).topk(8, dim=-1)
    assert torch.equal(ids.long(), ref_ids)
    assert_close(w, ref_w, WEIGHT_TOL[torch.float32])


def test_all_equal_picks_lowest_indices(device: torch.device) -> None:
    w, ids = topk_route(torch.zeros(4, 10, device=device), 3)
    assert ids.tolist() == [[0, 1, 2]] * 4
    torch.testing.assert_close(w, torch.full((4, 3), 1 / 3, device=device))
    bias = torch.zeros(256, device=device)
    _, ids = topk_route(torch.zeros(2, 256, device=device), 8, scoring="sigmoid", num_expert_group=8, topk_group=4,
                        e_score_correction_bias=bias)
    assert ids.tolist() == [list(range(8))] * 2


def test_strided_rows(device: torch.device) -> None:
    case = Case("strided", 9, 60, 4, scoring="sigmoid", groups=(4, 2), bias=True)
    wide = torch.randn(9, 80, device=device)
    check_route(case, wide[:, 5:65], 0.1 * torch.randn(60, device=device))


@pytest.mark.parametrize("case", [Case("nan_softmax", 8, 60, 4), Case("nan_dsv3", 8, 256, 8, **DSV3)], ids=lambda c: c.name)
def test_nan_logits(case: Case, device: torch.device) -> None:
    """NaN logits read as -inf: ids stay distinct and in range, even for an all-NaN row."""
    logits, bias = make_inputs(case, device)
    logits[torch.rand(logits.shape, device=device) < 0.3] = float("nan")
    logits[2] = float("nan")
    _, ids = check_route(case, logits, bias)
    if bias is None:
        assert ids[2].tolist() == list(range(case.topk))


BUCKETS = [
    Case("b_mixtral", 0, 8, 2),
    Case("b_odd", 0, 60, 4, scoring="sigmoid", bias=True),
    Case("b_qwen3", 0, 128, 8),
    Case("b_dsv3", 0, 256, 8, **DSV3),
]


@given(
    bucket=st.sampled_from(BUCKETS), m=st.sampled_from([1, 7, 40]), seed=st.integers(0, 2**31 - 1),
    renormalize=st.booleans(), ints=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_topk_route_property(bucket: Case, m: int, seed: int, renormalize: bool, ints: bool,
                             dtype: torch.dtype) -> None:
    case = replace(bucket, m=m, renormalize=renormalize, ints=ints, dtype=dtype)
    w, _ = check_route(case, *make_inputs(case, DEVICE, seed))
    if not case.bias:
        assert (w[:, :-1] >= w[:, 1:]).all(), "without a bias the weights come in descending order"


def test_m0_does_not_launch(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    monkeypatch.setattr(router, "_topk_route_kernel", None)
    w, ids = topk_route(torch.randn(0, 8, device=device), 2)
    assert w.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("args", [
    (torch.float32, 2, "softmax", True, 0, 0, False, 1.0),
    (torch.bfloat16, 8, "sigmoid", True, 8, 4, True, 2.5),
], ids=["softmax", "deepseek_v3"])
def test_opcheck(args: tuple, device: torch.device) -> None:
    dtype, topk, scoring, renorm, groups, kept, has_bias, scale = args
    e = 8 if groups == 0 else 256
    logits = torch.randn(5, e, device=device, dtype=dtype)
    bias = 0.1 * torch.randn(e, device=device) if has_bias else None
    torch.library.opcheck(torch.ops.tmoe.topk_route.default, (logits, topk, scoring, renorm, groups, kept, bias, scale))


def test_compile_dynamic(device: torch.device) -> None:
    fn = torch.compile(lambda l: torch.ops.tmoe.topk_route(l, 2, "softmax", True, 0, 0, None, 1.0),
                       fullgraph=True, dynamic=True)
    for m in (3, 17):
        logits = torch.randn(m, 8, device=device)
        w, ids = fn(logits)
        ref_w, ref_ids = topk_route(logits, 2)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w)


BAD = [
    (dict(router_logits=torch.zeros(4, 8, dtype=torch.int32)), TypeError, "router_logits"),
    (dict(router_logits=torch.zeros(8)), ValueError, "router_logits"),
    (dict(router_logits=torch.zeros(8, 4).t()), ValueError, "router_logits"),
    (dict(router_logits=torch.zeros(4, 1024)), ValueError, "num_experts"),
    (dict(topk=0), ValueError, "topk"),
    (dict(topk=9), ValueError, "topk"),
    (dict(topk=2.0), TypeError, "topk"),
    (dict(scoring="relu"), ValueError, "scoring"),
    (dict(num_expert_group=3, topk_group=1), ValueError, "num_expert_group"),
    (dict(num_expert_group=4), ValueError, "topk_group"),
    (dict(num_expert_group=4, topk_group=5), ValueError, "topk_group"),
    (dict(topk=5, num_expert_group=4, topk_group=2), ValueError, "topk"),
    (dict(e_score_correction_bias=torch.zeros(7)), ValueError, "e_score_correction_bias"),
    (dict(e_score_correction_bias=torch.zeros(8, dtype=torch.float16)), TypeError, "e_score_correction_bias"),
]


@pytest.mark.parametrize("bad,exc,match", BAD, ids=[f"{m}-{i}" for i, (_, _, m) in enumerate(BAD)])
def test_bad_inputs(bad: dict, exc: type, match: str) -> None:
    args = {"router_logits": torch.zeros(4, 8), "topk": 2, **bad}
    with pytest.raises(exc, match=match):
        topk_route(args.pop("router_logits"), args.pop("topk"), **args)


@pytest.mark.gpu
def test_cuda_graph_replay(device: torch.device) -> None:
    """Capture once, copy different logits into the same buffer, replay: equals eager."""
    logits = torch.randn(64, 256, device=device)
    bias = 0.1 * torch.randn(256, device=device)
    kwargs = dict(scoring="sigmoid", num_expert_group=8, topk_group=4, e_score_correction_bias=bias,
                  routed_scaling_factor=2.5)
    graph, (w, ids) = capture_cuda_graph(lambda: topk_route(logits, 8, **kwargs))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    ref_w, ref_ids = topk_route(logits, 8, **kwargs)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w)
