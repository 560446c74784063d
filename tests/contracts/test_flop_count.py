"""FlopCounterMode counts tmoe's layer op (2·M·topk·(K·rows(w1) + N·K)) and the GEMM stage ops,
and the counted calls still compute the reference."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import tmoe
from tmoe.reference import moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _counted(fn):
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, counter.get_total_flops(), counter.get_flop_counts()["Global"]


@pytest.mark.parametrize("activation, rows_per_n", [("silu", 2), ("relu2_no_mul", 1)])
def test_layer_op_flops(activation, rows_per_n):
    m, e, n, k, topk = 9, 4, 64, 96, 2
    p = make_problem(MoEShape(m, e, n, k, topk), torch.float32, "uniform", seed=4, device=DEVICE)
    w1 = p.w1[:, : rows_per_n * n].contiguous()
    args = (p.x, w1, p.w2, p.topk_weights, p.topk_ids)
    out, total, per_op = _counted(lambda: tmoe.fused_experts(*args, activation=activation))
    assert total == 2 * m * topk * (k * rows_per_n * n + n * k)
    assert set(per_op) == {torch.ops.tmoe.modular_forward}
    assert_close(out, moe_reference(*args, activation=activation), torch.float32)


def test_fused_moe_counts_router_and_experts():
    m, e, n, k, topk = 5, 4, 32, 64, 2
    layer = tmoe.FusedMoE(e, k, n, topk, dtype=torch.float32, device=DEVICE)
    _, total, _ = _counted(lambda: layer(torch.randn(m, k, device=DEVICE)))
    assert total == 2 * m * k * e + 2 * m * topk * (k * 2 * n + n * k)  # router linear + experts


def test_gemm_stage_ops_flops():
    m, e, n, k, topk = 7, 4, 64, 64, 2
    p = make_problem(MoEShape(m, e, n, k, topk), torch.float32, "uniform", seed=5, device=DEVICE)
    align = tmoe.moe_align_block_size(p.topk_ids, 16, e)
    h, up, _ = _counted(lambda: torch.ops.tmoe.moe_gemm_up(p.x, p.w1, *align, topk, 16))
    assert up == 2 * m * topk * k * 2 * n
    _, down, _ = _counted(lambda: torch.ops.tmoe.moe_gemm_down(h, p.w2, *align, topk, 16))
    assert down == 2 * m * topk * n * k
