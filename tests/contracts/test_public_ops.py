"""The public stage names (``tmoe.<stage>``) are calls of the stage ops: each compiles with
``fullgraph=True, dynamic=True`` into one graph over M; the stage GEMM ops pick the tiles the
layer picks; shape errors name the argument under compile and in eager; the layer is
inference-only and refuses in-place writes autograd or overlapping memory would break."""
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tmoe
import tmoe.config
import tmoe.modular.experts
import tmoe.ops.stages
from tmoe.config import GemmConfig, MoEConfig
from tmoe.reference import moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MS = (2, 3, 5, 9, 17, 33, 64, 129, 200)  # M=1 specialises in dynamo: checked on its own


@dataclass(frozen=True)
class Case:
    """A public stage call ``fn(*make(m))``, compiled over ``ms``. Sizes other than M differ from
    the first M (2), else dynamo's duck sizing would tie them to M."""

    fn: Callable
    make: Callable[[int], tuple]
    ms: tuple[int, ...] = MS


def _gen(m: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + m)


def _randn(m: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(m)).to(DEVICE)


def _distinct_ids(m: int, e: int, topk: int) -> torch.Tensor:
    return torch.rand(m, e, generator=_gen(m)).topk(topk, dim=-1).indices.to(torch.int32).to(DEVICE)


def _layer_args(m: int) -> tuple:
    p = make_problem(MoEShape(m, 4, 64, 48, 3), torch.float32, "uniform", seed=m, device=DEVICE)
    return p.x, p.w1, p.w2, p.topk_weights, p.topk_ids


_BIAS = torch.linspace(-0.1, 0.1, 16).to(DEVICE)

CASES = {
    "topk_route": Case(lambda logits: tmoe.topk_route(logits, 4), lambda m: (_randn(m, m, 16),)),
    "topk_route_grouped": Case(
        lambda logits, bias: tmoe.topk_route(logits, 4, scoring="sigmoid", num_expert_group=4, topk_group=2,
                                             e_score_correction_bias=bias, routed_scaling_factor=2.5),
        lambda m: (_randn(m, m, 16), _BIAS)),
    # E=128, topk=8: M*topk crosses E between M=9 and M=17 (the align sizes once branched there)
    "moe_align_block_size": Case(lambda ids: tmoe.moe_align_block_size(ids, 16, 128),
                                 lambda m: (_distinct_ids(m, 128, 8),)),
    "moe_reduce": Case(lambda y, ids, w: tmoe.moe_reduce(y, ids, 8, w),
                       lambda m: (_randn(m, m, 4, 48), _distinct_ids(m, 8, 4), _randn(m, m, 4).abs())),
    "per_token_group_quant_fp8": Case(lambda x: tmoe.per_token_group_quant_fp8(x, 32),
                                      lambda m: (_randn(m, m, 64),)),
    "per_token_quant_fp8": Case(tmoe.per_token_quant_fp8, lambda m: (_randn(m, m, 48),)),
    "static_quant_fp8": Case(tmoe.static_quant_fp8,
                             lambda m: (_randn(m, m, 48), torch.tensor([0.02], device=DEVICE))),
    # the whole layer under the interpreter is the slow one: fewer sizes, still crossing E and 64
    "fused_experts": Case(lambda *a: tmoe.fused_experts(*a), _layer_args, ms=(2, 3, 9, 33, 129)),
}


def _assert_same(got, want, name: str) -> None:
    """Integer outputs exactly, floating ones (fp8 codes as float32) within float32 tolerance."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), name
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{name}[{i}]")
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{name}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}")
    if want.dtype.is_floating_point:
        assert_close(got.float(), want.float(), torch.float32, name=name)
    else:
        assert torch.equal(got, want), f"{name}: integer outputs differ"


@pytest.mark.parametrize("name", list(CASES))
def test_public_stage_compiles_once(name):
    case = CASES[name]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(case.fn, fullgraph=True, dynamic=True, backend=counter)
    first = None
    with torch.no_grad():
        for m in case.ms:
            args = case.make(m)
            _assert_same(compiled(*args), case.fn(*args), f"{name}(M={m})")
            first = first or counter.frame_count
        assert counter.frame_count == first, f"{name} recompiled: {counter.frame_count} graphs over M={case.ms}"
        # more than one graph at the first call: dynamo traced the call twice (a restart, e.g. a
        # float argument traced as a SymFloat that a custom op's `float` cannot take)
        assert first == 1, f"{name}: the first call compiled {first} graphs (a restart), not one"
        one = case.make(1)
        _assert_same(compiled(*one), case.fn(*one), f"{name}(M=1)")


def test_fused_experts_matches_reference():
    args = _layer_args(33)
    assert_close(tmoe.fused_experts(*args), moe_reference(*args), torch.float32)


STAGE_POINTS = ((1, 8, 64, 128, 2), (40, 8, 64, 128, 2), (300, 8, 64, 128, 2))  # (M, E, N, K, topk)
TABLE_MS = (1, 2, 40, 80, 300, 600)  # neighbours 2, 80, 600 = M * topk: a lookup by slots picks them


def _tuned_table() -> dict[int, MoEConfig]:
    """One row per M, every row's tiles (block_n, block_k, group_m, warps, stages) its own."""
    block_m = (16, 16, 32, 32, 64, 64)
    table = {}
    for i, (m, bm) in enumerate(zip(TABLE_MS, block_m)):
        up = GemmConfig(bm, (32, 64)[i % 2], (64, 32)[i % 2], group_m=1 + i, num_warps=4, num_stages=2 + i % 2)
        down = GemmConfig(bm, (64, 32)[i % 2], (32, 64)[i % 2], group_m=11 + i, num_warps=2, num_stages=3 + i % 2)
        table[m] = MoEConfig(up, down)
    return table


@pytest.fixture
def tuned_table(tmp_path, monkeypatch):
    """A TMOE_CONFIG_DIR holding a tuned table for (E=8, N=64) on this device, lookup caches clear."""
    table = _tuned_table()
    device_name = tmoe.config.device_name(torch.device(DEVICE))
    tmoe.config.save_table(tmp_path / tmoe.config.config_file_name(8, 64, device_name, None), table)
    monkeypatch.setenv("TMOE_CONFIG_DIR", str(tmp_path))
    tmoe.config._lookup.cache_clear()
    tmoe.config.tables.load_table.cache_clear()
    yield table
    tmoe.config._lookup.cache_clear()
    tmoe.config.tables.load_table.cache_clear()


def _record_gemms(monkeypatch, module) -> list[tuple[str, GemmConfig]]:
    """Record ("up" | "down", GemmConfig) of every expert GEMM ``module`` launches."""
    calls, real = [], module.invoke_moe_gemm

    def recorder(*args, **kwargs):
        calls.append(("up" if kwargs["gated"] else "down", args[3]))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "invoke_moe_gemm", recorder)
    return calls


@pytest.mark.parametrize("m, e, n, k, topk", STAGE_POINTS)
def test_stage_ops_use_the_layers_tiles(m, e, n, k, topk, tuned_table, monkeypatch):
    p = make_problem(MoEShape(m, e, n, k, topk), torch.float32, "uniform", seed=m, device=DEVICE)
    ref = moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    layer_calls = _record_gemms(monkeypatch, tmoe.modular.experts)
    stage_calls = _record_gemms(monkeypatch, tmoe.ops.stages)
    with torch.no_grad(), tmoe.override_route("sorted"):
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
        block_m = tmoe.get_config(m, e, n, k, topk, torch.device(DEVICE)).block_m
        align = torch.ops.tmoe.moe_align_block_size(p.topk_ids, block_m, e)
        inter = torch.ops.tmoe.moe_gemm_up(p.x, p.w1, *align, topk, block_m)
        y = torch.ops.tmoe.moe_gemm_down(inter, p.w2, *align, topk, block_m)
    assert_close(out, ref, torch.float32, name="layer")
    assert_close((y.view(m, topk, k) * p.topk_weights[..., None]).sum(1), ref, torch.float32, name="stages")
    row = tuned_table[m]
    assert layer_calls == [("up", row.up), ("down", row.down)], "the layer did not take the tuned table's tiles"
    assert stage_calls == layer_calls, f"stage ops {stage_calls} != layer {layer_calls} at M={m}"


def test_shape_error_under_compile_names_the_argument():
    x, w1, w2, weights, ids = _layer_args(5)  # w2 (4, 48, 64)
    torch._dynamo.reset()
    compiled = torch.compile(tmoe.fused_experts, fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled(x, w1, w2[:, :, :32].contiguous(), weights, ids)
    assert "w2 must have shape (4, 48, 64)" in str(info.value), str(info.value)


def test_topk_ids_on_another_device_is_named():
    x, w1, w2, weights, ids = _layer_args(5)
    with pytest.raises(ValueError, match="topk_ids"):
        tmoe.fused_experts(x, w1, w2, weights, ids.to("meta"))


def test_inplace_refusals():
    x, w1, w2, weights, ids = _layer_args(5)
    with pytest.raises(RuntimeError, match="requires grad"):
        tmoe.fused_experts(x.clone().requires_grad_(), w1, w2, weights, ids, inplace=True)
    expanded = torch.randn(1, x.shape[1], device=DEVICE).expand(x.shape[0], -1)
    with pytest.raises(RuntimeError, match="overlap"):
        tmoe.fused_experts(expanded, w1, w2, weights, ids, inplace=True)
