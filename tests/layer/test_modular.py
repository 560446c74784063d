"""The modular kernel: both formats, chunking, expert_map, format checks, against the reference."""
import pytest
import torch

import tmoe
from tmoe.reference import moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, half_remote_expert_map, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def batched_kernel(capacity: int, local_experts: int) -> tmoe.FusedMoEModularKernel:
    return tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(capacity, local_experts),
                                      tmoe.BatchedTritonExperts(capacity))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["uniform", "skewed", "out_of_range", "one_hot"])
def test_batched_format_matches_reference(routing, dtype):
    shape = MoEShape(19, 4, 64, 72, 2)
    p = make_problem(shape, dtype, routing, seed=8, device=DEVICE)
    out = batched_kernel(shape.m * shape.topk, 4)(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), dtype)


def test_batched_capacity_drops_highest_slots_deterministically():
    """Capacity 3 per expert: each expert keeps its 3 lowest slots; dropped slots contribute 0."""
    shape = MoEShape(10, 2, 64, 64, 1)
    p = make_problem(shape, torch.float32, "uniform", seed=9, device=DEVICE)
    ids = torch.tensor([[0], [1], [0], [0], [1], [0], [0], [1], [1], [1]], dtype=torch.int32, device=DEVICE)
    out = batched_kernel(3, 2)(p.x, p.w1, p.w2, p.topk_weights, ids)
    kept = torch.zeros_like(ids, dtype=torch.bool)
    for e in range(2):
        kept[(ids[:, 0] == e).nonzero()[:3, 0]] = True
    ref = moe_reference(p.x, p.w1, p.w2, torch.where(kept, p.topk_weights, 0.0), ids)
    assert_close(out, ref, torch.float32)
    assert bool((out[~kept[:, 0]] == 0).all())


@pytest.mark.parametrize("fmt", ["standard", "batched"])
def test_expert_map_both_formats(fmt):
    shape = MoEShape(15, 8, 64, 64, 2)
    p = make_problem(shape, torch.float32, "out_of_range", seed=10, device=DEVICE)
    emap = half_remote_expert_map(8, DEVICE)
    local = torch.arange(8, device=DEVICE)[emap >= 0]
    w1, w2 = p.w1[local].contiguous(), p.w2[local].contiguous()
    kernel = (tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts()) if fmt == "standard"
              else batched_kernel(shape.m * shape.topk, 4))
    out = kernel(p.x, w1, w2, p.topk_weights, p.topk_ids, global_num_experts=8, expert_map=emap)
    ref = moe_reference(p.x, w1, w2, p.topk_weights, p.topk_ids, expert_map=emap, global_num_experts=8)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("inplace", [False, True])
def test_chunking_reuses_workspace(inplace):
    shape = MoEShape(37, 4, 64, 64, 2)
    p = make_problem(shape, torch.float32, "skewed", seed=12, device=DEVICE)
    ref = moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    kernel = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(), chunk_size=8)
    x = p.x.clone()
    out = kernel(x, p.w1, p.w2, p.topk_weights, p.topk_ids, inplace=inplace)
    assert_close(out, ref, torch.float32)
    assert (out.data_ptr() == x.data_ptr()) == inplace


def test_chunk_size_from_environment(monkeypatch):
    monkeypatch.setenv("TMOE_CHUNK_SIZE", "5")
    kernel = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts())
    assert kernel.chunk_size == 5
    p = make_problem(MoEShape(12, 4, 64, 64, 2), torch.float32, "uniform", seed=13, device=DEVICE)
    assert_close(kernel(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids),
                 moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), torch.float32)


def test_mismatched_formats_rejected_at_construction():
    with pytest.raises(ValueError, match="BatchedExperts|Standard"):
        tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.BatchedTritonExperts(8))
    with pytest.raises(ValueError, match="BatchedExperts|Standard"):
        tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(8, 4), tmoe.TritonExperts())


def test_batched_rejects_router_weight_on_input():
    p = make_problem(MoEShape(9, 4, 64, 64, 1), torch.float32, "uniform", seed=14, device=DEVICE)
    with pytest.raises(ValueError, match="apply_router_weight_on_input"):
        batched_kernel(9, 4)(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, apply_router_weight_on_input=True)


def test_zero_tokens_reach_this_rank():
    p = make_problem(MoEShape(0, 4, 64, 64, 2), torch.float32, "uniform", seed=0, device=DEVICE)
    for kernel in (tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts()), batched_kernel(4, 4)):
        assert kernel(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids).shape == (0, 64)
