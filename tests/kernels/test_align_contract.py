"""vLLM's align contract: ``moe_align_block_size(topk_ids, block_size, num_experts, expert_map)``
with no num_local_experts bounds the mapped ids by num_experts (no host sync) and matches the
reference, on each align path (one chunk, the sorting program, the three launches)."""
import pytest
import torch

import tmoe
from tmoe.reference import align_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m", [5, 300, 700])  # one chunk; the sorting program; the three launches
def test_align_with_expert_map_and_no_local_count(m):
    e, topk, block = 8, 2, 16
    g = torch.Generator().manual_seed(m)
    ids = torch.randint(0, e, (m, topk), generator=g, dtype=torch.int32).to(DEVICE)
    expert_map = torch.full((e,), -1, dtype=torch.int32)
    expert_map[torch.tensor([1, 2, 5, 6])] = torch.arange(4, dtype=torch.int32)  # this rank holds 4 experts
    expert_map = expert_map.to(DEVICE)
    sorted_ids, expert_ids, ntpp = tmoe.moe_align_block_size(ids, block, e, expert_map)
    ref_ids, ref_experts, ref_len = align_reference(ids.cpu(), block, e, expert_map.cpu(), num_local_experts=e)
    assert int(ntpp) == ref_len
    torch.testing.assert_close(sorted_ids.cpu()[:ref_len], ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(expert_ids.cpu()[: ref_len // block], ref_experts, rtol=0, atol=0)


def test_moe_reduce_with_expert_map_and_no_local_count():
    m, e, topk, k = 6, 4, 2, 32
    p = make_problem(MoEShape(m, e, 16, k, topk), torch.float32, "uniform", seed=3, device=DEVICE)
    y = torch.randn(m, topk, k, device=DEVICE)
    expert_map = torch.tensor([0, -1, 1, -1], dtype=torch.int32, device=DEVICE)
    out = tmoe.moe_reduce(y, p.topk_ids, e, p.topk_weights, expert_map)
    local = expert_map[p.topk_ids.long()] >= 0
    ref = (y * (p.topk_weights * local)[..., None]).sum(1)
    assert_close(out, ref, torch.float32)
