"""Expert GEMMs with TMA weight tiles (``GemmConfig.tma``) against the float32 reference: every
dtype and fp8 scheme, biases, remote experts, the Batched format, and the pointer fallback
where TMA cannot address the weights (K * element size not a multiple of 16 bytes)."""
import pytest
import torch

import tmoe
from tmoe.config import GemmConfig, MoEConfig, override_config
from tmoe.kernels.gemm_args import uniform_w_scale, weight_descriptor
from tmoe.kernels.operands import Scales
from tmoe.reference import moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, half_remote_swigluoai, make_problem, route_shape
from tests.layer.test_fp8_layer import SCHEMES, run_scheme

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tma_config(bm: int, up_bn: int, down_bn: int, bk: int) -> MoEConfig:
    return MoEConfig(GemmConfig(bm, up_bn, bk, group_m=2, tma=True), GemmConfig(bm, down_bn, bk, group_m=1, tma=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, tiles", [
    (MoEShape(21, 4, 96, 64, 2), (16, 64, 32, 32)),  # N=96: the last gate tile reads up rows (masked)
    (MoEShape(40, 8, 64, 80, 2), (32, 64, 32, 64)),  # K=80: the K tail zero-filled by TMA
    (MoEShape(9, 4, 64, 72, 2), (16, 16, 16, 16)),  # smallest tiles
    (MoEShape(7, 4, 64, 50, 2), (16, 32, 32, 32)),  # K=50: w1 rows not 16-byte aligned, pointer fallback
], ids=str)
def test_tma_layer_matches_reference(shape, tiles, dtype, matrix_route):
    p = make_problem(route_shape(shape, matrix_route), dtype, "skewed", seed=shape.m, device=DEVICE)
    with override_config(tma_config(*tiles)):
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), dtype)


@pytest.mark.parametrize("fmt", ["standard", "batched"])
def test_tma_biases_and_remote_experts(fmt):
    """Biases of both GEMMs (GPT-OSS swigluoai) and an expert map with half the experts remote:
    remote slots contribute exactly zero."""
    p = make_problem(MoEShape(23, 8, 64, 64, 2), torch.bfloat16, "out_of_range", seed=3, device=DEVICE)
    w1, w2, kwargs = half_remote_swigluoai(p, DEVICE)
    with override_config(tma_config(16, 32, 32, 32)):
        if fmt == "standard":
            out = tmoe.fused_experts(p.x, w1, w2, p.topk_weights, p.topk_ids, **kwargs)
        else:
            kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(46, 4), tmoe.BatchedTritonExperts(46))
            out = kernel(p.x, w1, w2, p.topk_weights, p.topk_ids, **kwargs)
    assert_close(out, moe_reference(p.x, w1, w2, p.topk_weights, p.topk_ids, **kwargs), torch.bfloat16)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("tiles", [(16, 64, 128, 128), (16, 128, 256, 64)], ids=str)
def test_tma_fp8_layer(scheme, tiles, fp8_matrix_route):
    """Block scales: block_n 64/128 up tiles take one weight scale per tile (uniform), the
    256-wide down tile a scale per row group; per-tensor and per-channel scales at the end."""
    p = make_problem(route_shape(MoEShape(19, 4, 256, 256, 2), fp8_matrix_route), torch.bfloat16, "uniform", seed=19,
                     device=DEVICE)
    with override_config(tma_config(*tiles)):
        out, ref = run_scheme(p, scheme)
    assert_close(out, ref, "fp8")


def test_weight_descriptor_only_where_tma_can_address():
    w = torch.randn(4, 64, 72, dtype=torch.bfloat16)
    assert weight_descriptor(w, GemmConfig(16, 32, 32)) is None  # tma off
    assert weight_descriptor(w, GemmConfig(16, 32, 32, tma=True)) is not None
    assert weight_descriptor(w, GemmConfig(16, 64, 32, tma=True, swap_ab=True)) is None  # swap_ab: pointers
    assert weight_descriptor(w[:, :, :50], GemmConfig(16, 32, 32, tma=True)) is not None  # 144-byte row stride
    assert weight_descriptor(torch.randn(4, 64, 50, dtype=torch.bfloat16), GemmConfig(16, 32, 32, tma=True)) is None
    assert weight_descriptor(w.transpose(1, 2), GemmConfig(16, 32, 32, tma=True)) is None  # N contiguous


def test_uniform_w_scale():
    block = Scales(torch.ones(1), torch.ones(1), (128, 128))
    assert uniform_w_scale(block, 256, 64, gated=True)
    assert not uniform_w_scale(block, 256, 256, gated=False)  # a 256-row tile spans two groups
    assert not uniform_w_scale(block, 192, 64, gated=True)  # up rows start at 192, inside a group
    assert uniform_w_scale(block, 192, 64, gated=False)
    assert not uniform_w_scale(Scales(torch.ones(1), torch.ones(1)), 256, 64, gated=True)
