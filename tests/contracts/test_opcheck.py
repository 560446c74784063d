"""torch.library.opcheck on every tmoe op: schema, fake tensors, aot dispatch (static and dynamic)."""
import pytest
import torch

import tmoe
from tmoe.modular.call import LayerArgs
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(routing: str):
    return make_problem(MoEShape(9, 4, 64, 72, 2), torch.float32, routing, seed=21, device=DEVICE)


def _cases():
    p = _problem("out_of_range")
    # the GEMM stages leave rows of out-of-range slots unwritten, so compare them on valid routing
    align = torch.ops.tmoe.moe_align_block_size(_problem("uniform").topk_ids, 16, 4)
    emap = torch.tensor([0, -1, 1, -1], dtype=torch.int32, device=DEVICE)
    inter = torch.randn(9 * 2, 64, device=DEVICE)
    y = torch.randn(9, 2, 72, device=DEVICE)
    b1, b2 = torch.randn(4, 128, device=DEVICE), torch.randn(4, 72, device=DEVICE)
    layer = tuple(LayerArgs(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, w1_bias=b1, w2_bias=b2))
    oai = tuple(LayerArgs(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, "swigluoai", w1_bias=b1, w2_bias=b2,
                          swiglu_alpha=1.3, swiglu_limit=0.5, gate_up_interleaved=True))
    w1n = p.w1[:, :64].contiguous()  # (E, N, K) for a non-gated activation
    relu2 = tuple(LayerArgs(p.x, w1n, p.w2, p.topk_weights, p.topk_ids, "relu2_no_mul",
                            w1_bias=b1[:, :64].contiguous(), w2_bias=b2))
    noep = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts()).spec.as_args()
    batched = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(18, 4), tmoe.BatchedTritonExperts(18),
                                         chunk_size=4).spec.as_args()
    return {
        "moe_align_block_size": (torch.ops.tmoe.moe_align_block_size, (p.topk_ids, 16, 4, None)),
        "moe_align_block_size_map": (torch.ops.tmoe.moe_align_block_size, (p.topk_ids, 16, 4, emap, 2)),
        "moe_gemm_up": (torch.ops.tmoe.moe_gemm_up, (p.x, p.w1, *align, 2, 16, "gelu")),
        "moe_gemm_up_no_mul": (torch.ops.tmoe.moe_gemm_up, (p.x, w1n, *align, 2, 16, "gelu_no_mul")),
        "moe_gemm_up_swigluoai": (torch.ops.tmoe.moe_gemm_up, (p.x, p.w1, *align, 2, 16, "swigluoai", None, None,
                                                               None, None, None, 1.3, 0.5, True)),
        "moe_gemm_down": (torch.ops.tmoe.moe_gemm_down, (inter, p.w2, *align, 2, 16, p.topk_weights)),
        "moe_reduce": (torch.ops.tmoe.moe_reduce, (y, p.topk_ids, 4, p.topk_weights, None)),
        "modular_forward": (torch.ops.tmoe.modular_forward, (*layer, *noep)),
        "modular_forward_": (torch.ops.tmoe.modular_forward_, (p.x.clone(), *layer[1:], *noep)),
        "modular_forward_batched": (torch.ops.tmoe.modular_forward, (*layer, *batched)),
        "modular_forward_swigluoai": (torch.ops.tmoe.modular_forward, (*oai, *noep)),
        "modular_forward_no_mul": (torch.ops.tmoe.modular_forward, (*relu2, *noep)),
        "modular_forward_no_mul_batched": (torch.ops.tmoe.modular_forward, (*relu2, *batched)),
        **_low_bit_cases(p, emap),
        **_low_bit_stage_cases(_problem("uniform"), align, inter),
        "topk_route": (torch.ops.tmoe.topk_route, (torch.randn(9, 4, device=DEVICE), 2)),
    }


def _low_bit_cases(p, emap) -> dict:
    """The layer op with int4 weights and zero points (expert_map, two experts local), mxfp4 weights,
    int8 weights without zero points in the batched format, and the in-place op with int4 weights
    without zero points."""
    q1, s1, z1 = tmoe.quantize_weight_int4(p.w1[:2], 32)
    q2, s2, z2 = tmoe.quantize_weight_int4(p.w2[:2], 32)
    int4 = LayerArgs(p.x, q1, q2, p.topk_weights, p.topk_ids, global_num_experts=4, expert_map=emap, w1_scale=s1,
                     w2_scale=s2, w1_zp=z1, w2_zp=z2)
    (m1, t1), (m2, t2) = tmoe.quantize_weight_mxfp4(p.w1), tmoe.quantize_weight_mxfp4(p.w2)
    mxfp4 = LayerArgs(p.x, m1, m2, p.topk_weights, p.topk_ids, w1_scale=t1, w2_scale=t2)

    (i1, u1, _), (i2, u2, _) = (tmoe.quantize_weight_int8(w, 32, zero_point=False) for w in (p.w1, p.w2))
    int8 = LayerArgs(p.x, i1, i2, p.topk_weights, p.topk_ids, w1_scale=u1, w2_scale=u2)
    (n1, v1, _), (n2, v2, _) = (tmoe.quantize_weight_int4(w, 64, zero_point=False) for w in (p.w1, p.w2))
    int4_no_zp = LayerArgs(p.x.clone(), n1, n2, p.topk_weights, p.topk_ids, w1_scale=v1, w2_scale=v2)

    def spec(quant):
        return tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(quant)).spec.as_args()

    int8_cfg = tmoe.FusedMoEQuantConfig(weight_dtype="int8", group_size=32)
    batched = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(18, 4),
                                         tmoe.BatchedTritonExperts(18, int8_cfg)).spec.as_args()
    return {
        "modular_forward_int8_batched": (torch.ops.tmoe.modular_forward, (*int8, *batched)),
        "modular_forward__int4_no_zp": (torch.ops.tmoe.modular_forward_,
                                        (*int4_no_zp, *spec(tmoe.FusedMoEQuantConfig(weight_dtype="int4",
                                                                                       group_size=64)))),
        "modular_forward_int4": (torch.ops.tmoe.modular_forward,
                                 (*int4, *spec(tmoe.FusedMoEQuantConfig(weight_dtype="int4", group_size=32)))),
        "modular_forward_mxfp4": (torch.ops.tmoe.modular_forward,
                                  (*mxfp4, *spec(tmoe.FusedMoEQuantConfig(weight_dtype="mxfp4")))),
    }


def _low_bit_stage_cases(p, align, inter) -> dict:
    """The GEMM stage ops on low-bit codes: int4 with zero points (up), mxfp4 (down)."""
    q1, s1, z1 = tmoe.quantize_weight_int4(p.w1, 32)
    q2, s2 = tmoe.quantize_weight_mxfp4(p.w2)
    return {
        "moe_gemm_up_int4": (torch.ops.tmoe.moe_gemm_up, (p.x, q1, *align, 2, 16, "silu", None, None, s1, None, None,
                                                          None, None, False, z1, "int4", 32)),
        "moe_gemm_down_mxfp4": (torch.ops.tmoe.moe_gemm_down, (inter, q2, *align, 2, 16, p.topk_weights, None, s2,
                                                               None, None, None, "mxfp4", 32)),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_opcheck(name):
    op, args = _cases()[name]
    torch.library.opcheck(op, args)
