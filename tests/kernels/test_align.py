"""Sort-and-align against tmoe.reference.align_reference: exact equality (integers)."""
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tmoe
from tmoe.kernels.align import align_output_sizes
from tmoe.reference import align_reference
from tmoe.testing.strategies import half_remote_expert_map, routing_ids


@dataclass(frozen=True)
class Case:
    m: int
    topk: int
    e: int
    block: int
    routing: str = "uniform"
    expert_map: bool = False


CASES = [
    Case(0, 2, 8, 16),
    Case(1, 2, 8, 16),
    Case(1, 1, 1, 16),
    Case(7, 8, 8, 16),  # topk = E
    Case(5, 2, 8, 16, "one_hot"),  # all tokens on the same experts
    Case(33, 2, 8, 32, "empty_experts"),
    Case(40, 3, 5, 16, "out_of_range"),
    Case(9, 8, 128, 16),  # numel < E: capped output length
    Case(300, 4, 8, 64),  # several chunks: the three-launch path
    Case(700, 2, 16, 32, "skewed"),
    Case(100, 8, 128, 16, "skewed"),  # E=128: 32-slot sub-tiles, seven 128-slot chunks
    Case(33, 8, 256, 64, "out_of_range"),  # E=256: 64-slot chunks
    Case(300, 8, 256, 64, "skewed"),  # E=256: 38 chunks, more than one scan step (16 chunks a step)
    Case(64, 2, 8, 16, "uniform", expert_map=True),
    Case(600, 2, 8, 16, "out_of_range", expert_map=True),
]


def check_align(ids: torch.Tensor, block: int, e: int, expert_map=None) -> None:
    num_local = None if expert_map is None else int((expert_map >= 0).sum())
    sorted_ids, expert_ids, ntpp = tmoe.moe_align_block_size(ids, block, e, expert_map, num_local_experts=num_local)
    max_padded, num_blocks = align_output_sizes(ids.numel(), block, e)
    assert sorted_ids.shape == (max_padded,) and expert_ids.shape == (num_blocks,) and ntpp.shape == (1,)
    assert sorted_ids.dtype == expert_ids.dtype == ntpp.dtype == torch.int32
    ref_ids, ref_experts, ref_len = align_reference(ids.cpu(), block, e, None if expert_map is None else expert_map.cpu())
    sorted_ids, expert_ids = sorted_ids.cpu(), expert_ids.cpu()
    assert int(ntpp) == ref_len
    torch.testing.assert_close(sorted_ids[:ref_len], ref_ids, rtol=0, atol=0)
    assert bool((sorted_ids[ref_len:] == ids.numel()).all()), "tail must hold the sentinel"
    torch.testing.assert_close(expert_ids[: ref_len // block], ref_experts, rtol=0, atol=0)
    assert bool((expert_ids[ref_len // block :] == 0).all()), "unused tail blocks must be 0"


@pytest.fixture(params=["chunks", "sort"])
def align_path(request, monkeypatch):
    """Past one chunk: the three launches, or the one sorting program with the three launches'
    first kernel removed, so a case that still took them would fail."""
    from tmoe.kernels import align
    from tmoe.runtime.state import clear_launch_caches

    if request.param == "chunks":
        monkeypatch.setattr(align, "SORT_MAX_SLOTS", 0)
    else:
        monkeypatch.setattr(align, "SORT_MAX_SLOTS", 4096)
        monkeypatch.setattr(align, "_align_count_kernel", None)
    clear_launch_caches()
    yield request.param
    clear_launch_caches()


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_align_cases(case, index_dtype, device, align_path):
    g = torch.Generator().manual_seed(case.m * 31 + case.e)
    ids = routing_ids(case.m, case.e, case.topk, case.routing, g).to(index_dtype).to(device)
    check_align(ids, case.block, case.e, half_remote_expert_map(case.e, device) if case.expert_map else None)


@given(
    m=st.sampled_from([1, 6, 50, 257]), e=st.sampled_from([3, 8, 64]), topk=st.sampled_from([1, 2, 4]),
    block=st.sampled_from([16, 64]), routing=st.sampled_from(["uniform", "skewed", "out_of_range", "one_hot"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_align_property(m, e, topk, block, routing, seed):
    """(Hypothesis: a function-scoped fixture would not reset between examples, so the sorting
    program is covered by ``test_align_cases`` and ``test_align_sort_matches_chunks``.)"""
    topk = min(topk, e)
    ids = routing_ids(m, e, topk, routing, torch.Generator().manual_seed(seed))
    check_align(ids.to(torch.device("cuda" if torch.cuda.is_available() else "cpu")), block, e)


def test_align_is_deterministic(device):
    ids = torch.randint(0, 8, (500, 2), dtype=torch.int32, device=device)
    first = tmoe.moe_align_block_size(ids, 16, 8)
    again = tmoe.moe_align_block_size(ids, 16, 8)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(topk_ids=torch.zeros(4, 2)), TypeError),
        (dict(block_size=12), ValueError),
        (dict(num_experts=0), ValueError),
        (dict(expert_map=torch.zeros(3, dtype=torch.int32)), ValueError),
        (dict(expert_map=torch.zeros(8, dtype=torch.int64)), TypeError),
        (dict(topk_ids=torch.zeros(4, 4, dtype=torch.int32)[:, ::2]), ValueError),
    ],
)
def test_align_bad_input(kwargs, error):
    args = dict(topk_ids=torch.zeros(4, 2, dtype=torch.int32), block_size=16, num_experts=8, expert_map=None)
    args.update(kwargs)
    with pytest.raises(error, match="topk_ids|block_size|num_experts|expert_map"):
        tmoe.moe_align_block_size(**args)


@pytest.mark.parametrize("e, numel", [(8, 4096), (128, 257), (256, 2000), (5, 1500)])
def test_align_sort_matches_chunks(e, numel, monkeypatch, device):
    """The sorting program gives exactly the three launches' outputs (``expert_offsets`` and an
    expert map included), at its largest size and at E above and below the slot count."""
    from tmoe.kernels import align
    from tmoe.runtime.state import clear_launch_caches

    g = torch.Generator().manual_seed(numel + e)
    ids = torch.randint(-1, e + 1, (numel,), generator=g, dtype=torch.int32).to(device)  # out-of-range ids too
    emap = half_remote_expert_map(e, device)
    outs = []
    for sort_max in (0, 4096):
        monkeypatch.setattr(align, "SORT_MAX_SLOTS", sort_max)
        clear_launch_caches()
        offsets = torch.full((e + 1,), -7, dtype=torch.int32, device=device)
        outs.append((*align.moe_align_block_size(ids, 16, e, emap, offsets, num_local_experts=int((emap >= 0).sum())),
                     offsets))
    clear_launch_caches()
    for chunks, sort in zip(*outs):
        assert torch.equal(chunks, sort)


@pytest.mark.parametrize("case", [Case(100, 8, 128, 16, "skewed"), Case(300, 8, 256, 64, "out_of_range"),
                                  Case(200, 8, 64, 16, "uniform", expert_map=True)], ids=str)
def test_align_grown_chunks(case, monkeypatch, device):
    """With few target chunks, each chunk walks many sub-tiles (up to ``MAX_CHUNK`` slots): the
    three launches still give the reference's outputs."""
    from tmoe.kernels import align
    from tmoe.runtime.state import clear_launch_caches

    monkeypatch.setattr(align, "SORT_MAX_SLOTS", 0)
    monkeypatch.setattr(align, "TARGET_CHUNKS", 2)
    clear_launch_caches()
    g = torch.Generator().manual_seed(case.m + case.e)
    ids = routing_ids(case.m, case.e, case.topk, case.routing, g).to(device)
    try:
        check_align(ids, case.block, case.e, half_remote_expert_map(case.e, device) if case.expert_map else None)
    finally:
        clear_launch_caches()
