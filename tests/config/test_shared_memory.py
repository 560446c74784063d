"""Tile configs fitted to the device's shared memory: smaller GPUs get tiles that fit and compute the same."""
import pytest
import torch

import tmoe
import tmoe.kernels.moe_down_reduce
import tmoe.kernels.moe_fused_decode
import tmoe.kernels.moe_gemm
import tmoe.kernels.moe_grouped_gemm
from tmoe.kernels.gemm_args import fit_shared_memory
from tmoe.runtime.state import clear_launch_caches
from tmoe.runtime.device import EPILOGUE_MARGIN, SHARED_MEMORY_BUDGET, shared_memory_budget
from tmoe.reference import moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _staged_bytes(cfg: tmoe.GemmConfig, elem_size: int, gated: bool, weight_size: float | None = None) -> float:
    w_size = elem_size if weight_size is None else weight_size
    return cfg.num_stages * cfg.block_k * (cfg.block_m * elem_size + cfg.block_n * (2 if gated else 1) * w_size)


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

    def spy(config, elem_size, gated, budget, weight_size=None):
        out = fit_shared_memory(config, elem_size, gated, budget, weight_size)
        fitted.append((_staged_bytes(out, elem_size, gated, weight_size), budget))
        return out

    for module in (tmoe.kernels.moe_gemm, tmoe.kernels.moe_down_reduce, tmoe.kernels.moe_fused_decode,
                   tmoe.kernels.moe_grouped_gemm):
        monkeypatch.setattr(module, "shared_memory_budget", lambda device: budget)
        monkeypatch.setattr(module, "fit_shared_memory", spy)
    clear_launch_caches()  # a plan from an earlier test of this signature would skip the launcher bodies
    p = make_problem(MoEShape(21, 4, 128, 128, 2), dtype, "uniform", seed=4, device=DEVICE)
    big = tmoe.GemmConfig(16, 128, 128, num_stages=4)
    with tmoe.override_config(tmoe.MoEConfig(big, big, direct_down=big)):
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert fitted and all(need <= b == budget for need, b in fitted)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), dtype)


def test_low_bit_layer_with_a_small_shared_memory_budget(route, monkeypatch):
    """int4 codes at a 24 KB budget: the launchers fit the tiles counting the codes' packed bytes
    (so fewer cuts than at the activations' size), and the layer still matches the reference."""
    from tmoe.reference import dequantize_int_reference

    budget = 24 * 1024
    fitted = []

    def spy(config, elem_size, gated, budget, weight_size=None):
        out = fit_shared_memory(config, elem_size, gated, budget, weight_size)
        fitted.append((_staged_bytes(out, elem_size, gated, weight_size), budget, weight_size))
        return out

    for module in (tmoe.kernels.moe_gemm, tmoe.kernels.moe_down_reduce, tmoe.kernels.moe_fused_decode,
                   tmoe.kernels.moe_grouped_gemm):
        monkeypatch.setattr(module, "shared_memory_budget", lambda device: budget)
        monkeypatch.setattr(module, "fit_shared_memory", spy)
    clear_launch_caches()  # a plan from an earlier test of this signature would skip the launcher bodies
    p = make_problem(MoEShape(21, 4, 128, 128, 2), torch.bfloat16, "uniform", seed=4, device=DEVICE)
    (q1, s1, z1), (q2, s2, z2) = (tmoe.quantize_weight_int4(w, 32) for w in (p.w1, p.w2))
    big = tmoe.GemmConfig(16, 128, 128, num_stages=4)
    with tmoe.override_config(tmoe.MoEConfig(big, big, direct_down=big)):
        out = tmoe.fused_experts(p.x, q1, q2, p.topk_weights, p.topk_ids, w1_scale=s1, w2_scale=s2, w1_zp=z1,
                                 w2_zp=z2, quant_config=tmoe.FusedMoEQuantConfig(weight_dtype="int4", group_size=32))
    assert fitted and all(need <= b == budget and w == 0.5 for need, b, w in fitted)
    ref = moe_reference(p.x, dequantize_int_reference(q1, s1, z1, 32, 4), dequantize_int_reference(q2, s2, z2, 32, 4),
                        p.topk_weights, p.topk_ids)
    assert_close(out, ref, torch.bfloat16)


def test_fit_counts_packed_weight_bytes():
    """Staged B tiles of low-bit codes take their packed bytes (half a byte a 4-bit value, one an
    int8 one), not the activations' size: the int4 decode tile 16 x (2 x 128) x 128 at 4 stages
    (80 KB) fits the H200's 200 KB as written; counted at 2 bytes a value it would be cut to 2 stages."""
    cfg = tmoe.GemmConfig(16, 128, 128, num_stages=4)
    assert fit_shared_memory(cfg, 2, True, SHARED_MEMORY_BUDGET, weight_size=0.5) == cfg
    assert fit_shared_memory(cfg, 2, True, SHARED_MEMORY_BUDGET, weight_size=1) == cfg
    assert fit_shared_memory(cfg, 2, True, SHARED_MEMORY_BUDGET).num_stages == 2


@pytest.mark.parametrize("pattern,files,elem_size,weight_size", [
    ("*w*a16.json", 9, 2, lambda name: 1 if "int8" in name else 0.5),  # low-bit codes, bf16 activations
    ("*fp8_w8a8*.json", 6, 1, lambda name: 1),  # fp8 activations and weights
], ids=["low_bit", "fp8"])
def test_shipped_rows_run_as_written(pattern, files, elem_size, weight_size):
    """Every row of the shipped low-bit and fp8 tables fits the H200's budget as written (the
    staged tiles at their bytes a value), so a row states the stages and block_k its kernels run
    (and were timed) with."""
    from pathlib import Path

    from tmoe.config import read_table
    from tmoe.config.tables import SHIPPED_CONFIGS

    paths = sorted(Path(SHIPPED_CONFIGS).glob(pattern))
    assert len(paths) == files
    for path in paths:
        w_size = weight_size(path.name)
        for m, row in read_table(path).items():
            for cfg, gated in ((row.up, True), (row.down, False), (row.direct_down, False)):
                if cfg is not None:
                    assert fit_shared_memory(cfg, elem_size, gated, SHARED_MEMORY_BUDGET, w_size) == cfg, \
                        (path.name, m, cfg)


def test_budget_off_a_gpu_is_fixed():
    assert shared_memory_budget(torch.device("cpu")) == SHARED_MEMORY_BUDGET == 200 * 1024


@pytest.mark.gpu
def test_budget_is_read_from_the_device():
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    want = props.shared_memory_per_block_optin - EPILOGUE_MARGIN
    assert shared_memory_budget(torch.device("cuda")) == want
    if props.major == 9:  # Hopper: 227 KB opt-in
        assert want == 200 * 1024
