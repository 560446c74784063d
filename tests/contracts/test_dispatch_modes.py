"""Dispatch modes and tensor subclasses see tmoe's layer op: the eager fast path (which skips the
dispatcher) steps aside for FakeTensorMode, FlopCounterMode, a user's TorchDispatchMode, the meta
device and tensor subclasses."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tmoe
from tmoe.reference import moe_reference
from tmoe.testing import RecordOps, assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_fused_experts_under_fake_tensor_mode_gives_shapes():
    with FakeTensorMode():
        p = make_problem(MoEShape(5, 4, 64, 64, 2), torch.bfloat16, "uniform", seed=0, device=DEVICE)
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert out.shape == (5, 64) and out.dtype == torch.bfloat16


def test_fused_moe_under_fake_tensor_mode_gives_shapes():
    layer = tmoe.FusedMoE(4, 64, 32, 2, dtype=torch.float32, device=DEVICE)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = layer(torch.randn(3, 7, 64, device=DEVICE))
    assert out.shape == (3, 7, 64) and out.dtype == torch.float32


def test_user_dispatch_mode_sees_the_layer_op_and_the_result_is_unchanged():
    p = make_problem(MoEShape(9, 4, 64, 64, 2), torch.float32, "uniform", seed=1, device=DEVICE)
    args = (p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    with RecordOps() as mode:
        out = tmoe.fused_experts(*args)
    assert "tmoe::modular_forward" in mode.names
    assert_close(out, moe_reference(*args), torch.float32)


class Tagged(torch.Tensor):
    """A tensor subclass that only carries a tag (plain torch function handling)."""


def test_tensor_subclass_takes_the_op_path():
    p = make_problem(MoEShape(6, 4, 64, 64, 2), torch.float32, "skewed", seed=2, device=DEVICE)
    x = p.x.as_subclass(Tagged)
    from tmoe.fused import takes_op_path
    from tmoe.modular.call import LayerArgs

    assert takes_op_path(LayerArgs(x, p.w1, p.w2, p.topk_weights, p.topk_ids))
    assert not takes_op_path(LayerArgs(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids))
    out = tmoe.fused_experts(x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert_close(out.as_subclass(torch.Tensor), moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids),
                 torch.float32)


def test_parameters_keep_the_fast_path():
    layer = tmoe.FusedMoE(4, 64, 32, 2, dtype=torch.float32, device=DEVICE)
    from tmoe.fused import takes_op_path
    from tmoe.modular.call import LayerArgs

    x = torch.randn(3, 64, device=DEVICE)
    weights, ids = layer.route(x @ layer.router_weight.T)
    with torch.no_grad():
        assert not takes_op_path(LayerArgs(x, layer.w1, layer.w2, weights, ids))


@pytest.mark.parametrize("name", ["hidden_states", "topk_ids"])
def test_a_list_in_place_of_a_tensor_is_named(name):
    p = make_problem(MoEShape(3, 4, 64, 64, 2), torch.float32, "uniform", seed=3)
    args = dict(hidden_states=p.x, w1=p.w1, w2=p.w2, topk_weights=p.topk_weights, topk_ids=p.topk_ids)
    args[name] = args[name].tolist()
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got list"):
        tmoe.fused_experts(**args)
