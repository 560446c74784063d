"""The programmatic-dependent-launch switch (``tmoe.override_pdl``): the layer's results do not
change with it (under the interpreter the gdc calls must never run; on
a Hopper GPU the PDL kernels run), and launch plans are kept per switch state. That the PDL variants compile for
sm_90 is checked in test_sm90_compile.py."""
import pytest
import torch

import tmoe
from tmoe.config import config_state
from tmoe.runtime import state
from tmoe.runtime.interpreter import INTERPRETED
from tmoe.runtime.pdl import pdl_args, pdl_requested
from tmoe.reference import dequantize_fp8_reference, moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
SHAPES = [MoEShape(1, 8, 128, 256, 2), MoEShape(13, 4, 128, 128, 2)]


def _layer(p, quant: str):
    """(layer call, float32 reference) of problem ``p``: bf16, or fp8 with per-token or [128, 128] block scales."""
    if quant == "none":
        return (lambda: tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids),
                moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids))
    if quant == "block":
        config = tmoe.FusedMoEQuantConfig(FP8, block_shape=(128, 128))
        (w1q, s1), (w2q, s2) = (tmoe.quantize_weight_per_block_fp8(w, (128, 128)) for w in (p.w1, p.w2))
        w1d, w2d = dequantize_fp8_reference(w1q, s1, (128, 128)), dequantize_fp8_reference(w2q, s2, (128, 128))
    else:
        config = tmoe.FusedMoEQuantConfig(FP8, per_act_token_quant=True, per_out_ch_quant=True)
        (w1q, s1), (w2q, s2) = (tmoe.quantize_weight_per_channel_fp8(w) for w in (p.w1, p.w2))
        w1d, w2d = w1q.float() * s1, w2q.float() * s2
    return (lambda: tmoe.fused_experts(p.x, w1q, w2q, p.topk_weights, p.topk_ids, quant_config=config,
                                       w1_scale=s1, w2_scale=s2),
            moe_reference(p.x, w1d, w2d, p.topk_weights, p.topk_ids))


# every route of each scheme; fp8 activations have no fused path (forced, they take the sorted one)
ROUTES = [(quant, route) for quant in ("none", "token", "block")
          for route in ("sorted", "direct", "slots", "fused") if quant == "none" or route != "fused"]


@pytest.mark.parametrize("quant, route", ROUTES, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_switch_keeps_results(shape, quant, route):
    p = make_problem(shape, torch.bfloat16, "uniform", seed=shape.m, device=DEVICE)
    call, ref = _layer(p, quant)
    with tmoe.override_route(route):
        off = call()
        with tmoe.override_pdl(True):
            on = call()
    assert_close(on, ref, FP8 if quant != "none" else torch.bfloat16)
    torch.testing.assert_close(on, off, rtol=0, atol=0)


def test_switch_is_config_state():
    off = config_state()
    with tmoe.override_pdl(True):
        assert pdl_requested() and config_state() != off
        with tmoe.override_pdl(False):
            assert not pdl_requested() and config_state() == off
    assert config_state() == off
    with pytest.raises(TypeError, match="bool"):
        with tmoe.override_pdl(1):
            pass


def test_pdl_only_on_a_hopper_gpu():
    with tmoe.override_pdl(True):
        args = pdl_args()
    capable = not INTERPRETED and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    assert args == ({"USE_PDL": True, "launch_pdl": True} if capable else {"USE_PDL": False})
    assert pdl_args() == {"USE_PDL": False}


def test_plans_are_kept_per_switch_state():
    """A planned launcher's body reads the switch: a plan made with PDL off is not replayed with it on."""
    p = make_problem(MoEShape(3, 4, 64, 64, 2), torch.float32, "uniform", seed=1, device=DEVICE)
    state.clear_launch_caches()

    def plans() -> int:
        return sum(len(table) for table in state.plan_tables)

    tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    off = plans()
    with tmoe.override_pdl(True):
        tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert off > 0 and plans() == 2 * off
