"""The persistent expert GEMM (``GemmConfig.persistent``: few programs, each looping over output
tiles; four programs under the interpreter) against the float32 reference: more tiles than
programs, M = 0 and 1, empty experts, remote experts, fp8 per-token and block scales, the fused
fp8 intermediate, and the configs that fall back to one program per tile."""
import pytest
import torch

import tmoe
from tmoe.config import GemmConfig, MoEConfig, override_config, read_table, save_table
from tmoe.kernels.gemm_args import persistent_epilogue_bytes
from tmoe.runtime.device import INTERPRETER_PROGRAMS, persistent_programs
from tmoe.reference import moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, half_remote_swigluoai, make_problem
from tests.layer.test_fp8_layer import SCHEMES, run_scheme

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def persistent_config(bm: int, up_bn: int, down_bn: int, bk: int, group_m: int = 2) -> MoEConfig:
    def cfg(bn: int) -> GemmConfig:
        return GemmConfig(bm, bn, bk, group_m=group_m, tma=True, persistent=True)

    return MoEConfig(cfg(up_bn), cfg(down_bn))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, routing, tiles", [
    (MoEShape(40, 8, 64, 64, 2), "skewed", (16, 32, 32, 32)),  # ~12 row blocks x 2 column tiles per program set
    (MoEShape(33, 8, 96, 80, 2), "empty_experts", (16, 64, 32, 32)),  # N, K tails; experts without tokens
    (MoEShape(1, 4, 64, 64, 2), "uniform", (16, 32, 64, 32)),  # M=1: fewer tiles than programs
    (MoEShape(0, 4, 64, 64, 2), "uniform", (16, 32, 32, 32)),  # M=0
], ids=str)
def test_persistent_layer_matches_reference(shape, routing, tiles, dtype):
    """The whole layer: gated silu up GEMM, down GEMM with the routed weights."""
    p = make_problem(shape, dtype, routing, seed=shape.m, device=DEVICE)
    with tmoe.override_route("sorted"), override_config(persistent_config(*tiles)):
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), dtype)


def test_persistent_biases_and_remote_experts():
    """Biases of both GEMMs (swigluoai), half the experts remote (their tiles store zeros), the
    routed weight applied in the up GEMM."""
    p = make_problem(MoEShape(29, 8, 64, 64, 2), torch.bfloat16, "uniform", seed=5, device=DEVICE)
    w1, w2, kwargs = half_remote_swigluoai(p, DEVICE)
    kwargs["apply_router_weight_on_input"] = True
    x = p.x
    topk_weights, topk_ids = p.topk_weights[:, :1].contiguous(), p.topk_ids[:, :1].contiguous()
    with tmoe.override_route("sorted"), override_config(persistent_config(16, 32, 32, 32)):
        out = tmoe.fused_experts(x, w1, w2, topk_weights, topk_ids, **kwargs)
    assert_close(out, moe_reference(x, w1, w2, topk_weights, topk_ids, **kwargs), torch.bfloat16)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s.name in ("token", "block")], ids=lambda s: s.name)
def test_persistent_fp8(scheme):
    """Per-token/per-channel scales (applied after the K loop) and 128 x 128 block scales (per K
    tile; the up GEMM's epilogue quantizes the intermediate per 1 x 128 group)."""
    p = make_problem(MoEShape(37, 4, 256, 256, 2), torch.bfloat16, "skewed", seed=37, device=DEVICE)
    with tmoe.override_route("sorted"), override_config(persistent_config(16, 128, 128, 128)):
        out, ref = run_scheme(p, scheme)
    assert_close(out, ref, "fp8")


def test_persistent_falls_back_where_it_cannot_apply():
    """K=50: w1's rows are not 16-byte aligned, so the up GEMM has no TMA descriptor and takes one
    program per tile (the down GEMM stays persistent); the decode route takes one program per tile."""
    p = make_problem(MoEShape(7, 4, 64, 50, 2), torch.bfloat16, "uniform", seed=7, device=DEVICE)
    ref = moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    for route in ("sorted", "direct"):
        with tmoe.override_route(route), override_config(persistent_config(16, 32, 32, 32)):
            out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
        assert_close(out, ref, torch.bfloat16)


def test_persistent_config_needs_tma_and_round_trips(tmp_path):
    with pytest.raises(ValueError, match="persistent needs tma"):
        GemmConfig(64, 64, 64, persistent=True)
    table = {256: persistent_config(64, 128, 128, 64)}
    save_table(tmp_path / "t.json", table)
    assert read_table(tmp_path / "t.json") == table
    (tmp_path / "old.json").write_text('{"8": {"up": {"block_m": 16, "block_n": 64, "block_k": 64, "tma": true},'
                                       ' "down": {"block_m": 16, "block_n": 32, "block_k": 64}}}')
    assert not read_table(tmp_path / "old.json")[8].up.persistent  # tables without the field load unchanged


def test_persistent_programs():
    assert persistent_programs(torch.device("cpu"), 100) == INTERPRETER_PROGRAMS
    assert persistent_programs(torch.device("cpu"), 3) == 3


def test_persistent_epilogue_bytes():
    """A 128 x 256 bf16 output tile (64 KB) takes 37 KB beyond the epilogue margin; small tiles none."""
    assert persistent_epilogue_bytes(GemmConfig(128, 256, 64, tma=True, persistent=True), 2) == 64 * 1024 - 27 * 1024
    assert persistent_epilogue_bytes(GemmConfig(64, 64, 64, tma=True, persistent=True), 2) == 0
    assert persistent_epilogue_bytes(GemmConfig(128, 256, 64, tma=True), 2) == 0
