"""Each GEMM stage and the reduce alone, through their custom ops, against float32 references."""
import pytest
import torch

import tmoe  # noqa: F401  (registers the ops)
from tmoe.reference import act_and_mul_reference, valid_slots
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_M = 16


def _routing(p, expert_map=None):
    num_local = None if expert_map is None else int((expert_map >= 0).sum())
    return torch.ops.tmoe.moe_align_block_size(p.topk_ids, BLOCK_M, p.w1.shape[0], expert_map, num_local)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("shape", [MoEShape(0, 4, 64, 64, 2), MoEShape(9, 4, 100, 72, 2), MoEShape(30, 8, 64, 64, 1)],
                         ids=str)
def test_gemm_up_stage(shape, activation, dtype):
    p = make_problem(shape, dtype, "out_of_range", seed=1, device=DEVICE)
    out = torch.ops.tmoe.moe_gemm_up(p.x, p.w1, *_routing(p), shape.topk, BLOCK_M, activation)
    assert out.shape == (shape.m * shape.topk, shape.n)
    ok = valid_slots(p.topk_ids, shape.e).reshape(-1)
    ids = p.topk_ids.reshape(-1).long().clamp(0, shape.e - 1)
    x = p.x.float().repeat_interleave(shape.topk, dim=0)  # row of each slot
    h = torch.einsum("sk,snk->sn", x, p.w1.float()[ids])
    ref = act_and_mul_reference(h[:, : shape.n], h[:, shape.n :], activation)
    assert_close(out[ok], ref[ok], dtype)
    assert bool(out[~ok].isnan().all()), "slots of out-of-range experts must be left unwritten"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mul_weights", [False, True])
def test_gemm_down_stage(mul_weights, dtype):
    shape = MoEShape(11, 4, 100, 72, 2)
    p = make_problem(shape, dtype, "uniform", seed=2, device=DEVICE)
    inter = torch.randn(shape.m * shape.topk, shape.n, device=DEVICE).to(dtype)
    weights = p.topk_weights if mul_weights else None
    out = torch.ops.tmoe.moe_gemm_down(inter, p.w2, *_routing(p), shape.topk, BLOCK_M, weights)
    ids = p.topk_ids.reshape(-1).long()
    ref = torch.einsum("sn,skn->sk", inter.float(), p.w2.float()[ids])
    if mul_weights:
        ref = ref * p.topk_weights.reshape(-1, 1)
    assert_close(out, ref, dtype)


def test_remote_expert_blocks_write_zeros():
    shape = MoEShape(10, 4, 64, 64, 2)
    p = make_problem(shape, torch.float32, "uniform", seed=4, device=DEVICE)
    emap = torch.tensor([0, -1, 1, -1], dtype=torch.int32, device=DEVICE)
    out = torch.ops.tmoe.moe_gemm_up(p.x, p.w1[:2].contiguous(), *_routing(p, emap), shape.topk, BLOCK_M)
    remote = (p.topk_ids.reshape(-1) % 2 == 1)
    assert bool((out[remote] == 0).all())
    assert bool(torch.isfinite(out[~remote]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_weights", [False, True])
def test_reduce_stage(with_weights, dtype):
    m, topk, k, e = 13, 3, 100, 6
    y = torch.randn(m, topk, k, device=DEVICE).to(dtype)
    ids = torch.randint(-1, e + 1, (m, topk), dtype=torch.int32, device=DEVICE)
    y[~valid_slots(ids, e)] = float("nan")  # memory nothing wrote: must never be read
    w = torch.rand(m, topk, device=DEVICE)
    out = torch.ops.tmoe.moe_reduce(y, ids, e, w if with_weights else None)
    ok = valid_slots(ids, e).unsqueeze(-1)
    scale = w.unsqueeze(-1) if with_weights else 1.0
    ref = torch.where(ok, y.float() * scale, 0.0).sum(1)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("scheme,group,zero_point", [("int4", 32, True), ("int8", 64, False), ("mxfp4", 32, False)])
def test_low_bit_gemm_stages(scheme, group, zero_point):
    """moe_gemm_up and moe_gemm_down on low-bit codes (``weight_dtype``, ``group_size``, ``w_zp``),
    then moe_reduce, against the float32 layer on the dequantized weights; N = 48 and K = 80 are not
    multiples of the tiles, out-of-range ids contribute zero. Eager and under torch.compile
    (fullgraph, the fakes' shapes)."""
    from tmoe.reference import dequantize_int_reference, dequantize_mxfp4_reference, moe_reference

    shape = MoEShape(7, 4, 48, 80, 2)
    p = make_problem(shape, torch.bfloat16, "out_of_range", seed=3, device=DEVICE)
    if scheme == "mxfp4":
        (q1, s1), (q2, s2) = tmoe.quantize_weight_mxfp4(p.w1), tmoe.quantize_weight_mxfp4(p.w2)
        z1 = z2 = None
        d1, d2 = dequantize_mxfp4_reference(q1, s1), dequantize_mxfp4_reference(q2, s2)
    else:
        quantize = tmoe.quantize_weight_int4 if scheme == "int4" else tmoe.quantize_weight_int8
        (q1, s1, z1), (q2, s2, z2) = (quantize(w, group, zero_point=zero_point) for w in (p.w1, p.w2))
        bits = 4 if scheme == "int4" else 8
        d1, d2 = (dequantize_int_reference(q, s, z, group, bits) for q, s, z in ((q1, s1, z1), (q2, s2, z2)))
    low_bit = dict(weight_dtype=scheme, group_size=group)

    def layer(x, weights, ids):
        align = torch.ops.tmoe.moe_align_block_size(ids, BLOCK_M, shape.e)
        h = torch.ops.tmoe.moe_gemm_up(x, q1, *align, shape.topk, BLOCK_M, w_scale=s1, w_zp=z1, **low_bit)
        y = torch.ops.tmoe.moe_gemm_down(h, q2, *align, shape.topk, BLOCK_M, w_scale=s2, w_zp=z2, **low_bit)
        return torch.ops.tmoe.moe_reduce(y.view(shape.m, shape.topk, -1), ids, shape.e, weights)

    ref = moe_reference(p.x, d1, d2, p.topk_weights, p.topk_ids)
    eager = layer(p.x, p.topk_weights, p.topk_ids)
    assert_close(eager, ref, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)(p.x, p.topk_weights, p.topk_ids)
    assert torch.equal(compiled, eager)
