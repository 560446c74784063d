"""Kernels stay inside their buffers: expert_map entries outside [-1, E_local) behave exactly
like -1 (remote) in every launcher, a skipped slot's router weight is never read (a NaN there
cannot reach a valid row), and addresses past 2**31 elements are int64.

The local weights are the first E_local experts of a NaN-filled buffer: a read of expert
E_local or beyond returns NaN instead of passing unnoticed."""
from dataclasses import dataclass

import pytest
import torch

from tmoe.config import GemmConfig
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.dispatch import batched_dispatch
from tmoe.kernels.moe_down_reduce import moe_down_reduce
from tmoe.kernels.moe_fused_decode import fused_decode_blocks, moe_fused_decode, moe_partial_reduce
from tmoe.kernels.operands import DirectRouting, Routing
from tmoe.kernels.moe_gemm import invoke_moe_gemm
from tmoe.kernels.reduce import moe_reduce
from tmoe.kernels.route import Route
from tmoe.reference import moe_reference, valid_slots
from tmoe.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E_LOCAL = 3
# global expert g -> local id; 5, 2**31 - 1 and -7 are bad entries, and local expert 2 has no global id
EXPERT_MAP = [0, 5, -1, 1, -7, 2**31 - 1]
E = len(EXPERT_MAP)
N, K = 64, 72


@dataclass(frozen=True)
class Layer:
    x: torch.Tensor  # [M, K]
    w1: torch.Tensor  # [E_LOCAL, 2N, K], a view into a NaN-filled [E, 2N, K] buffer
    w2: torch.Tensor  # [E_LOCAL, K, N], likewise
    weights: torch.Tensor  # [M, topk] float32, NaN on every slot that must be skipped
    ids: torch.Tensor  # [M, topk] int32, ids in [-1, E]
    emap: torch.Tensor  # [E] int32

    def reference(self) -> torch.Tensor:
        return moe_reference(self.x, self.w1, self.w2, self.weights, self.ids, expert_map=self.emap,
                             global_num_experts=E)


def _layer(m: int, topk: int, dtype: torch.dtype, seed: int) -> Layer:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).to(dtype)
    w1 = torch.full((E, 2 * N, K), float("nan"), dtype=dtype)
    w2 = torch.full((E, K, N), float("nan"), dtype=dtype)
    w1[:E_LOCAL] = (torch.randn(E_LOCAL, 2 * N, K, generator=g) / K**0.5).to(dtype)
    w2[:E_LOCAL] = (torch.randn(E_LOCAL, K, N, generator=g) / N**0.5).to(dtype)
    ids = torch.randint(-1, E + 1, (m, topk), generator=g, dtype=torch.int32)
    emap = torch.tensor(EXPERT_MAP, dtype=torch.int32)
    weights = torch.rand(m, topk, generator=g)
    weights[~valid_slots(ids, E, emap, E_LOCAL)] = float("nan")
    to = dict(device=DEVICE)
    return Layer(x.to(**to), w1.to(**to)[:E_LOCAL], w2.to(**to)[:E_LOCAL], weights.to(**to), ids.to(**to),
                 emap.to(**to))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sorted_route_skips_bad_map_entries(dtype):
    p = _layer(37, 3, dtype, seed=1)
    m, topk = p.ids.shape
    cfg = GemmConfig(16, 32, 32)
    sorted_ids, expert_ids, ntpp = moe_align_block_size(p.ids, 16, E, p.emap, num_local_experts=E_LOCAL)
    inter = torch.empty(m * topk, N, dtype=dtype, device=DEVICE)
    invoke_moe_gemm(p.x, p.w1, inter, cfg, gated=True, routing=Routing(sorted_ids, expert_ids, ntpp, m * topk, topk))
    y = torch.empty(m * topk, K, dtype=dtype, device=DEVICE)
    invoke_moe_gemm(inter, p.w2, y, cfg, gated=False, routing=Routing(sorted_ids, expert_ids, ntpp, m * topk, 1))
    out = moe_reduce(y.view(m, topk, K), p.ids, E, p.weights, p.emap, num_local_experts=E_LOCAL)
    assert_close(out, p.reference(), dtype)


def test_align_maps_bad_entries_to_minus_one():
    ids = torch.arange(E, dtype=torch.int32, device=DEVICE).repeat(5, 1)  # every expert, 5 slots each
    emap = torch.tensor(EXPERT_MAP, dtype=torch.int32, device=DEVICE)
    _, expert_ids, ntpp = moe_align_block_size(ids, 16, E, emap, num_local_experts=E_LOCAL)
    want = [v if 0 <= v < E_LOCAL else -1 for v in EXPERT_MAP]  # one block per expert
    assert int(ntpp) == 16 * E and expert_ids[:E].tolist() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_route_skips_bad_map_entries(dtype):
    p = _layer(5, 4, dtype, seed=2)
    m, topk = p.ids.shape
    cfg = GemmConfig(16, 32, 32)
    inter = torch.empty(m * topk, N, dtype=dtype, device=DEVICE)
    invoke_moe_gemm(p.x, p.w1, inter, cfg, gated=True, routing=DirectRouting(p.ids, E, p.emap, topk), route=Route.SLOTS)
    out = torch.empty(m, K, dtype=dtype, device=DEVICE)
    moe_down_reduce(inter, p.w2, out, p.ids, E, cfg, topk_weights=p.weights, expert_map=p.emap)
    assert_close(out, p.reference(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_skips_bad_map_entries(dtype):
    """The fused decode kernel computes nothing for skipped slots (their router weights are NaN
    here) and the reduce never reads their partial rows (left as torch.empty's NaN)."""
    p = _layer(5, 4, dtype, seed=5)
    m, topk = p.ids.shape
    ok = valid_slots(p.ids, E, p.emap, E_LOCAL)
    weights = p.weights.masked_fill(~ok, float("nan"))
    cfg = GemmConfig(16, 32, 32)
    partial = torch.empty(m * topk, fused_decode_blocks(N, cfg), K, dtype=torch.float32, device=DEVICE)
    moe_fused_decode(p.x, p.w1, p.w2, partial, p.ids, E, cfg, n=N, topk_weights=weights, expert_map=p.emap)
    out = torch.empty(m, K, dtype=dtype, device=DEVICE)
    moe_partial_reduce(partial, p.ids, E, out, expert_map=p.emap, num_local_experts=E_LOCAL)
    assert bool(partial.view(m, topk, -1)[~ok].isnan().all()), "skipped slots must not be written"
    assert_close(out, p.reference(), dtype)


def test_batched_dispatch_skips_bad_map_entries():
    p = _layer(29, 2, torch.float32, seed=3)
    m, topk = p.ids.shape
    capacity = m * topk
    batches, _, counts, rows = batched_dispatch(p.x, p.ids, E, E_LOCAL, capacity, expert_map=p.emap)
    local = torch.where(valid_slots(p.ids, E, p.emap, E_LOCAL), p.emap[p.ids.clamp(0, E - 1).long()], -1)
    assert counts.tolist() == [int((local == e).sum()) for e in range(E_LOCAL)]  # local 2: no global id, 0
    in_range = (p.ids >= 0) & (p.ids < E)
    assert bool((rows[in_range & (local < 0)] == -1).all())
    kept = in_range & (rows >= 0)  # slots of out-of-range ids are left unwritten
    tokens = torch.arange(m, device=DEVICE)[:, None].expand(m, topk)[kept]
    assert torch.equal(batches.view(-1, K)[rows[kept].long()], p.x[tokens])
    cfg = GemmConfig(16, 32, 32)
    inter = torch.empty(E_LOCAL, capacity, N, device=DEVICE)
    invoke_moe_gemm(batches, p.w1, inter, cfg, gated=True, expert_num_tokens=counts, route=Route.BATCHED)
    y = torch.empty(E_LOCAL, capacity, K, device=DEVICE)
    invoke_moe_gemm(inter, p.w2, y, cfg, gated=False, expert_num_tokens=counts, route=Route.BATCHED)
    out = moe_reduce(y.view(-1, K), p.ids, E, p.weights, rows=rows)
    assert_close(out, p.reference(), torch.float32)


@pytest.mark.parametrize("with_map", [False, True])
def test_reduce_never_reads_a_skipped_slots_weight(with_map):
    """Remote, bad-map and out-of-range slots with NaN weights (and NaN outputs) contribute 0."""
    m, topk, k = 11, 4, 40
    ids = torch.randint(-1, E + 1, (m, topk), dtype=torch.int32, device=DEVICE)
    emap = torch.tensor(EXPERT_MAP, dtype=torch.int32, device=DEVICE) if with_map else None
    ok = valid_slots(ids, E, emap, E_LOCAL if with_map else None)
    y = torch.randn(m, topk, k, device=DEVICE).masked_fill(~ok[..., None], float("nan"))
    w = torch.rand(m, topk, device=DEVICE).masked_fill(~ok, float("nan"))
    out = moe_reduce(y, ids, E, w, emap, num_local_experts=E_LOCAL if with_map else None)
    ref = torch.where(ok[..., None], y * w[..., None], 0.0).sum(1)
    assert_close(out, ref, torch.float32)


def test_expert_map_local_expert_count_must_be_a_count():
    """None is vLLM's contract (bounded by num_experts: tests/kernels/test_align_contract.py); a
    count that is not a non-negative int is named."""
    ids = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    emap = torch.tensor(EXPERT_MAP, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="num_local_experts"):
        moe_align_block_size(ids, 16, E, emap, num_local_experts=-1)
    with pytest.raises(ValueError, match="num_local_experts"):
        moe_reduce(torch.zeros(2, 2, 8, device=DEVICE), ids, E, None, emap, num_local_experts=-1)


@pytest.mark.gpu
@pytest.mark.large_memory
def test_dispatch_addresses_past_2_to_the_31_elements():
    """One expert's batch of capacity * K > 2**31 fp8 elements: rows near its end land where
    they belong (an int32 row * stride wraps negative)."""
    k, topk = 16384, 8
    capacity = 2**31 // k + 64
    m = capacity // topk + 8  # every slot on expert 0: the last 64 slots are dropped
    x = torch.randint(-100, 100, (m, k), dtype=torch.int8, device="cuda").view(torch.float8_e4m3fn)
    ids = torch.zeros(m, topk, dtype=torch.int32, device="cuda")
    batches, _, counts, rows = batched_dispatch(x, ids, 1, 1, capacity)
    assert batches.numel() > 2**31 and counts.tolist() == [capacity]
    slots = torch.arange(m * topk, device="cuda").view(m, topk)
    assert torch.equal(rows, torch.where(slots < capacity, slots, -1).int())
    for row in (capacity - 1, capacity - 2, capacity // 2 + 3, 2**31 // k):
        assert torch.equal(batches[0, row].view(torch.int8), x[row // topk].view(torch.int8)), row
