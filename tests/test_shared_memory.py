"""Tile configs fitted to the device's shared memory: smaller GPUs get tiles that fit and compute the same."""
import pytest
import torch

import tmoe
import tmoe.kernels.moe_down_reduce
import tmoe.kernels.moe_fused_decode
import tmoe.kernels.moe_gemm
from tmoe.kernels.gemm_args import EPILOGUE_MARGIN, SHARED_MEMORY_BUDGET, fit_shared_memory, shared_memory_budget
from tmoe.reference import moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _staged_bytes(cfg: tmoe.GemmConfig, elem_size: int, gated: bool) -> int:
    return cfg.num_stages * cfg.block_k * (cfg.block_m + cfg.block_n * (2 if gated else 1)) * elem_size


@pytest.mark.parametrize("budget_kb", [99, 48])
@pytest.mark.parametrize("elem_size, gated", [(2, True), (2, False), (1, True)])
def test_fit_shrinks_tiles_to_a_small_budget(budget_kb, elem_size, gated):
    cfg = tmoe.GemmConfig(64, 128, 128, num_stages=4)
    fitted = fit_shared_memory(cfg, elem_size, gated, budget_kb * 1024)
    assert _staged_bytes(fitted, elem_size, gated) <= budget_kb * 1024 < _staged_bytes(cfg, elem_size, gated)
    assert (fitted.block_m, fitted.block_n) == (cfg.block_m, cfg.block_n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_with_a_small_shared_memory_budget(dtype, route, monkeypatch):
    """Launchers fit every tile config to the device's budget; the fitted tiles compute the same layer."""
    budget = 48 * 1024
    fitted = []

    def spy(config, elem_size, gated, budget):
        out = fit_shared_memory(config, elem_size, gated, budget)
        fitted.append((_staged_bytes(out, elem_size, gated), budget))
        return out

    for module in (tmoe.kernels.moe_gemm, tmoe.kernels.moe_down_reduce, tmoe.kernels.moe_fused_decode):
        monkeypatch.setattr(module, "shared_memory_budget", lambda device: budget)
        monkeypatch.setattr(module, "fit_shared_memory", spy)
    p = make_problem(MoEShape(21, 4, 128, 128, 2), dtype, "uniform", seed=4, device=DEVICE)
    big = tmoe.GemmConfig(16, 128, 128, num_stages=4)
    with tmoe.override_config(tmoe.MoEConfig(big, big, direct_down=big)):
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert fitted and all(need <= b == budget for need, b in fitted)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), dtype)


def test_budget_off_a_gpu_is_fixed():
    assert shared_memory_budget(torch.device("cpu")) == SHARED_MEMORY_BUDGET == 200 * 1024


@pytest.mark.gpu
def test_budget_is_read_from_the_device():
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    want = props.shared_memory_per_block_optin - EPILOGUE_MARGIN
    assert shared_memory_budget(torch.device("cuda")) == want
    if props.major == 9:  # Hopper: 227 KB opt-in
        assert want == 200 * 1024
