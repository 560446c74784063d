"""Expert parallelism, both PrepareAndFinalize implementations (all-gather and all-to-all) on
every rank against the single-process float32 reference over all experts: gloo on CPU with 2
and 4 processes (one spawn per world size runs every case; on a GPU host too, the ranks seeing no
GPU), NCCL on >= 2 GPUs, and a CUDA-graph
replay of an all-to-all and an all-gather step with new routing (world sizes 1, 2 and 4, as
many as there are GPUs).

Tolerances: ``TOLERANCES["bfloat16"]`` and ``["fp8"]`` (tmoe.testing.tolerance); the fp8
reference runs on the dequantized weights and the group-quantized-then-dequantized input (the
intermediate's quantization is the remaining error; the tiny K keeps few terms per output). Inside the
spawned ranks ``torch.empty`` is NaN-poisoned as in conftest, so an unwritten row shows up.
"""
from __future__ import annotations

import os
import pickle
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tmoe.kernels.ep_permute import ep_permute
from tmoe.modular.placement import expert_map, local_expert_ids, shard_experts

E, N, K, TOPK, BLOCK = 8, 32, 64, 2, (32, 32)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _gloo_ranks_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks spawned from here see no GPU, so they run tmoe's kernels on CPU under the Triton
    interpreter (as CPU CI does), on a GPU host too."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class Case:
    counts: tuple[int, ...]  # tokens per rank
    routing: str  # uniform | one_rank (every slot on rank 0's experts) | out_of_range
    dtype: str  # bf16 | fp8 (block (32, 32))
    placement: str
    capacity: int | None = None  # None: max_tokens_per_rank, no drops


CASES = {
    2: [Case((3, 5), "uniform", "bf16", "contiguous"),
        Case((0, 4), "uniform", "bf16", "round_robin"),
        Case((4, 2), "one_rank", "fp8", "round_robin"),
        Case((5, 3), "one_rank", "bf16", "contiguous", capacity=2),
        Case((3, 6), "out_of_range", "fp8", "contiguous", capacity=1)],
    4: [Case((2, 0, 5, 1), "uniform", "bf16", "contiguous"),
        Case((3, 3, 0, 4), "one_rank", "fp8", "round_robin", capacity=2),
        Case((1, 6, 2, 2), "out_of_range", "bf16", "round_robin", capacity=1),
        Case((4, 1, 3, 0), "uniform", "fp8", "contiguous")],
}


def _poison_empty() -> None:
    from tmoe.testing import poison

    real_empty, real_empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **kw: poison(real_empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(real_empty_like(*a, **kw))


def _routing(case: Case, m: int, world: int, g: torch.Generator) -> torch.Tensor:
    from tmoe.testing.strategies import routing_ids

    if case.routing != "one_rank":
        return routing_ids(m, E, TOPK, case.routing, g)
    owned = local_expert_ids(E, world, 0, case.placement)
    return owned[torch.rand(m, owned.numel(), generator=g).topk(TOPK, dim=-1).indices].to(torch.int32)


def _dropped(ids: torch.Tensor, counts: tuple[int, ...], capacity: int) -> torch.Tensor:
    """(M, topk) bool: slots beyond the first ``capacity`` of their (sending rank, expert), slot order."""
    dropped = torch.zeros(ids.shape, dtype=torch.bool)
    start = 0
    for c in counts:
        flat = ids[start:start + c].reshape(-1)
        seen: dict[int, int] = {}
        for i, e in enumerate(flat.tolist()):
            if 0 <= e < E:
                seen[e] = seen.get(e, 0) + 1
                dropped[start + i // TOPK, i % TOPK] = seen[e] > capacity
        start += c
    return dropped


def _run_case(case: Case, seed: int, device: torch.device) -> None:
    import tmoe
    from tmoe.reference import dequantize_fp8_reference, moe_reference, per_token_group_quant_fp8_reference
    from tmoe.testing import assert_close

    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed)  # every rank draws the same global problem
    total = sum(case.counts)
    x = torch.randn(total, K, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * N, K, generator=g) / K**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, K, N, generator=g) / N**0.5).to(torch.bfloat16)
    weights = torch.rand(total, TOPK, generator=g)
    ids = _routing(case, total, world, g)
    qc, scales, tol = tmoe.FusedMoEQuantConfig(), (None, None), "bfloat16"
    if case.dtype == "fp8":
        qc, tol = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=BLOCK), "fp8"
        (w1, s1), (w2, s2) = (tmoe.quantize_weight_per_block_fp8(w, BLOCK) for w in (w1, w2))
        scales = (s1, s2)
        w1_ref, w2_ref = dequantize_fp8_reference(w1, s1, BLOCK), dequantize_fp8_reference(w2, s2, BLOCK)
        x_ref = dequantize_fp8_reference(*per_token_group_quant_fp8_reference(x, BLOCK[1]), (BLOCK[1],))
    else:
        w1_ref, w2_ref, x_ref = w1, w2, x
    max_tokens = max(max(case.counts), 1)
    capacity = case.capacity or max_tokens
    dropped = _dropped(ids, case.counts, capacity)
    start = sum(case.counts[:rank])
    rows = slice(start, start + case.counts[rank])
    ref_full = moe_reference(x_ref, w1_ref, w2_ref, weights, ids)[rows]
    ref_a2a = moe_reference(x_ref, w1_ref, w2_ref, torch.where(dropped, 0.0, weights), ids)[rows]

    to = dict(device=device)
    shard = dict(world_size=world, rank=rank, placement=case.placement)
    call = dict(global_num_experts=E, expert_map=expert_map(E, world, rank, case.placement, device),
                w1_scale=shard_experts(scales[0], **shard), w2_scale=shard_experts(scales[1], **shard))
    call = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    w1_r, w2_r = shard_experts(w1, **shard).to(**to), shard_experts(w2, **shard).to(**to)
    name = f"world {world} rank {rank} {case}"

    pf = tmoe.AllToAllPrepareAndFinalize(None, max_tokens, E, case.capacity, case.placement)
    pf.reset_dropped_slots(device)
    kernel = tmoe.FusedMoEModularKernel(pf, tmoe.BatchedTritonExperts(pf.expert_capacity, qc))
    out = kernel(x[rows].to(**to), w1_r, w2_r, weights[rows].to(**to), ids[rows].to(**to), **call)
    assert_close(out, ref_a2a, tol, name=f"alltoall {name}")
    want = int(dropped[rows].sum())
    got = int(pf.dropped_slots(device))
    assert got == want, f"alltoall {name}: {got} slots dropped, want {want}"
    assert case.capacity is None or bool(dropped.any()), f"{case} was meant to overflow its capacity"

    pad = max_tokens - case.counts[rank]  # all-gather: every rank passes the same token count
    x_ag = torch.cat([x[rows], torch.zeros(pad, K, dtype=x.dtype)])
    ids_ag = torch.cat([ids[rows], torch.full((pad, TOPK), -1, dtype=ids.dtype)])
    w_ag = torch.cat([weights[rows], torch.zeros(pad, TOPK)])
    kernel = tmoe.FusedMoEModularKernel(tmoe.AllGatherPrepareAndFinalize(), tmoe.TritonExperts(qc))
    out = kernel(x_ag.to(**to), w1_r, w2_r, w_ag.to(**to), ids_ag.to(**to), **call)
    assert_close(out[: case.counts[rank]], ref_full, tol, name=f"allgather {name}")


def _run_layers(device: torch.device) -> None:
    """``FusedMoE`` and ``replace_moe_blocks`` with an ``ExpertParallel`` shard themselves and
    match the unsharded layer (uneven tokens per rank)."""
    import tmoe
    from tmoe.modular import LayerArgs
    from tmoe.reference import moe_reference
    from tmoe.testing import assert_close

    rank = dist.get_rank()
    torch.manual_seed(0)  # the same full layer on every rank
    full = tmoe.FusedMoE(E, K, N, TOPK, dtype=torch.float32, device=device)
    gate, up, down = list(full.w1[:, :N]), list(full.w1[:, N:]), list(full.w2)
    x = torch.randn(3 + 2 * rank, K, device=device)
    weights, ids = full.route(x @ full.router_weight.T)
    ref = moe_reference(x, full.w1, full.w2, weights, ids)
    for ep in (tmoe.ExpertParallel(max_tokens_per_rank=8, placement="round_robin"),
               tmoe.ExpertParallel(mode="allgather")):
        layer = tmoe.FusedMoE.from_experts(gate, up, down, TOPK, router_weight=full.router_weight, expert_parallel=ep)
        assert layer.w1.shape[0] == E // dist.get_world_size()
        xs = x if ep.mode == "alltoall" else x[:3]  # all-gather: the same token count on every rank
        out = layer(xs)
        assert_close(out, ref[: xs.shape[0]], torch.float32, name=f"FusedMoE {ep}")
        # by value: the layer op rebuilds the kernel from its spec (group by name); a pickled copy runs the same
        w, i = layer.route(xs @ layer.router_weight.T)
        args = LayerArgs(xs, layer.w1, layer.w2, w, i, global_num_experts=E, expert_map=layer.expert_map)
        assert torch.equal(torch.ops.tmoe.modular_forward(*args, *layer.kernel.spec.as_args()), out)
        assert torch.equal(pickle.loads(pickle.dumps(layer))(xs), out)

    transformers = pytest.importorskip("transformers")
    from tmoe.integrations.transformers import replace_moe_blocks

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=K, intermediate_size=N, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                                        num_experts_per_tok=TOPK)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).to(device).eval()
    tokens = torch.randint(3, 64, (1, 4 + rank), device=device)
    with torch.no_grad():
        before = model(tokens).logits
        replace_moe_blocks(model, strict=True, expert_parallel=tmoe.ExpertParallel(max_tokens_per_rank=8))
        after = model(tokens).logits
    assert_close(after, before, torch.float32, name="Mixtral with expert parallel experts")


def _bad_inputs(device: torch.device) -> None:
    """docs/bad_inputs.md, expert parallelism: each raises before any launch or collective."""
    import tmoe

    world = dist.get_world_size()
    pf = tmoe.AllToAllPrepareAndFinalize(None, 4, E)
    kernel = tmoe.FusedMoEModularKernel(pf, tmoe.BatchedTritonExperts(pf.expert_capacity))
    x = torch.randn(5, K, device=device)
    w1, w2 = torch.randn(E // world, 2 * N, K, device=device), torch.randn(E // world, K, N, device=device)
    ids = torch.zeros(5, 1, dtype=torch.int32, device=device)
    weights = torch.ones(5, 1, device=device)
    call = dict(global_num_experts=E, expert_map=expert_map(E, world, dist.get_rank(), device=device))
    bad = [
        (lambda: tmoe.AllToAllPrepareAndFinalize(None, 4, E + 1), "must be a multiple of the world size"),
        (lambda: tmoe.AllToAllPrepareAndFinalize(None, 4, E, placement="striped"), "placement must be one of"),
        (lambda: tmoe.AllToAllPrepareAndFinalize(None, 0, E), "max_tokens_per_rank must be positive"),
        (lambda: tmoe.ExpertParallel(), "max_tokens_per_rank must be positive"),
        (lambda: tmoe.ExpertParallel(mode="alltoallv"), "mode must be one of"),
        (lambda: kernel(x, w1, w2, weights, ids, **call), "5 tokens, more than max_tokens_per_rank=4"),
        (lambda: kernel(x[:4], w1, w2, weights[:4], ids[:4], apply_router_weight_on_input=True, **call),
         "apply_router_weight_on_input is not supported"),
        (lambda: kernel(x[:4], w1[:1], w2[:1], weights[:4], ids[:4], **call), "needs 4 local experts in w1/w2"),
        (lambda: kernel(x[:4], w1, w2, weights[:4], ids[:4], global_num_experts=2 * E,
                        expert_map=torch.full((2 * E,), -1, dtype=torch.int32, device=device)),
         "global_num_experts=16 differs"),
    ]
    for fn, message in bad:
        with pytest.raises(ValueError, match=message):
            fn()


def _rank_main(rank: int, world: int, init_file: str, backend: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    _poison_empty()
    try:
        for i, case in enumerate(CASES[world]):
            _run_case(case, seed=100 + i, device=device)
        if world == 2:
            _bad_inputs(device)
            _run_layers(device)
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, *args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(world, os.path.join(tmp, "init"), *args), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_gloo(world, monkeypatch):
    _gloo_ranks_on_cpu(monkeypatch)
    _spawn(_rank_main, world, "gloo")


@pytest.mark.gpu
def test_expert_parallel_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _spawn(_rank_main, 2, "nccl")
    if torch.cuda.device_count() >= 4:
        _spawn(_rank_main, 4, "nccl")


def _graph_main(rank: int, world: int, init_file: str, kind: str) -> None:
    """One layer step of ``kind`` ("alltoall" or "allgather") captured as a CUDA graph, replayed on
    new routing (skewed, so that the all-to-all's capacity overflows) and compared with eager calls."""
    import tmoe
    from tmoe.testing import assert_close, capture_cuda_graph

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dev, m, e = torch.device("cuda", rank), 64, 16
        if kind == "alltoall":
            pf = tmoe.AllToAllPrepareAndFinalize(None, m, e, capacity=8, placement="round_robin")
            kernel = tmoe.FusedMoEModularKernel(pf, tmoe.BatchedTritonExperts(pf.expert_capacity))
        else:
            pf = tmoe.AllGatherPrepareAndFinalize()
            kernel = tmoe.FusedMoEModularKernel(pf, tmoe.TritonExperts())
        emap = expert_map(e, world, rank, "round_robin", dev)
        w1 = shard_experts(torch.randn(e, 256, 128, device=dev, dtype=torch.bfloat16) / 11, world, rank, "round_robin")
        w2 = shard_experts(torch.randn(e, 128, 128, device=dev, dtype=torch.bfloat16) / 11, world, rank, "round_robin")
        x = torch.randn(m, 128, device=dev, dtype=torch.bfloat16)
        weights, ids = torch.randn(m, e, device=dev).softmax(-1).topk(4)
        ids = ids.to(torch.int32)
        step = lambda: kernel(x, w1, w2, weights, ids, global_num_experts=e, expert_map=emap)  # noqa: E731
        if kind == "alltoall":
            pf.dropped_slots(dev)
        graph, out = capture_cuda_graph(step)
        for seed in range(3):  # new routing, skewed so that some slots overflow
            torch.manual_seed(seed + 10 * rank)
            skew = torch.linspace(0, 4, e, device=dev)
            new_w, new_ids = (torch.randn(m, e, device=dev) + skew).softmax(-1).topk(4)
            x.copy_(torch.randn_like(x))
            weights.copy_(new_w)
            ids.copy_(new_ids.to(torch.int32))
            before = int(pf.dropped_slots(dev)) if kind == "alltoall" else 0
            graph.replay()
            torch.cuda.synchronize()
            replayed = out.clone()
            from_graph = int(pf.dropped_slots(dev)) - before if kind == "alltoall" else 0
            eager = step()
            assert_close(replayed, eager, torch.bfloat16, name=f"{kind} world {world} rank {rank} replay {seed}")
            if kind == "alltoall":
                assert from_graph == int(pf.dropped_slots(dev)) - before - from_graph > 0
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_cuda_graph_replay_new_routing(kind, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    _spawn(_graph_main, world, kind)


@pytest.mark.parametrize("placement", ["contiguous", "round_robin"])
def test_placement_helpers(placement):
    world = 4
    maps = torch.stack([expert_map(E, world, r, placement) for r in range(world)])
    assert ((maps >= 0).sum(0) == 1).all(), "every expert has exactly one owner"
    for r in range(world):
        owned = local_expert_ids(E, world, r, placement)
        assert maps[r][owned].tolist() == list(range(E // world))
        w = torch.randn(E, 3, 2)
        assert torch.equal(shard_experts(w, world, r, placement), w[owned])
    assert expert_map(8, 2, 1, "round_robin").tolist() == [-1, 0, -1, 1, -1, 2, -1, 3]
    assert shard_experts(None, world, 0, placement) is None
    with pytest.raises(ValueError, match="multiple of the world size"):
        expert_map(6, 4, 0, placement)
    with pytest.raises(ValueError, match="placement must be one of"):
        expert_map(8, 4, 0, "striped")


@pytest.mark.parametrize("to_batch", [True, False])
def test_ep_permute_against_torch(to_batch):
    """Segment (W, E_local, C) rows <-> packed (E_local, W * C) batches; untouched rows keep their NaN."""
    world, e_local, cap, d = 3, 2, 4, 24
    counts = torch.tensor([4, 0, 2, 3, 1, 4], dtype=torch.int32, device=DEVICE)  # (W, E_local)
    per = counts.view(world, e_local)
    offsets = (per.cumsum(0) - per).to(torch.int32).view(-1)
    src = torch.randn(world * e_local * cap, d, dtype=torch.bfloat16, device=DEVICE)
    out = ep_permute(src, counts, offsets, num_local_experts=e_local, capacity=cap, to_batch=to_batch)
    want = torch.full_like(src, float("nan"))
    for s in range(world):
        for local in range(e_local):
            c, o = int(per[s, local]), int(offsets[s * e_local + local])
            seg = slice((s * e_local + local) * cap, (s * e_local + local) * cap + c)
            batch = slice(local * world * cap + o, local * world * cap + o + c)
            if to_batch:
                want[batch] = src[seg]
            else:
                want[seg] = src[batch]
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out[~out.isnan()], want[~want.isnan()])


def test_no_process_group_is_a_clear_error():
    """Without init_process_group (this process has none) the default group is refused by name."""
    import tmoe

    assert not dist.is_initialized()
    want = "expert parallelism needs a process group: call torch.distributed.init_process_group"
    for make in (lambda: tmoe.ExpertParallel(max_tokens_per_rank=4), lambda: tmoe.AllToAllPrepareAndFinalize(None, 4, 8),
                 lambda: tmoe.AllGatherPrepareAndFinalize()):
        with pytest.raises(RuntimeError, match=want):
            make()
    with pytest.raises(ValueError, match="mode must be one of"):  # the value's own checks come first
        tmoe.ExpertParallel(mode="ring", max_tokens_per_rank=4)


# all-gather over 2 ranks with chunking and out-of-range ids, each rank its own tokens and experts
ALL_GATHER_WORLD = 2


def _all_gather_rank_main(rank: int, init_file: str, chunk_size: int, routing: str) -> None:
    import tmoe
    from tmoe.modular import AllGatherPrepareAndFinalize
    from tmoe.reference import moe_reference
    from tmoe.testing import assert_close
    from tmoe.testing.strategies import MoEShape, make_problem

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= ALL_GATHER_WORLD
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=ALL_GATHER_WORLD)
    try:
        e_global, m_local = 8, 6
        # every rank draws the same global problem, then takes its tokens and its experts
        p = make_problem(MoEShape(ALL_GATHER_WORLD * m_local, e_global, 64, 72, 2), torch.float32, routing, seed=5, device=device)
        experts = torch.arange(e_global, device=device)
        mine = experts % ALL_GATHER_WORLD == rank
        expert_map = torch.where(mine, torch.cumsum(mine.int(), 0) - 1, -1).to(torch.int32)
        kernel = tmoe.FusedMoEModularKernel(AllGatherPrepareAndFinalize(), tmoe.TritonExperts(), chunk_size=chunk_size)
        rows = slice(rank * m_local, (rank + 1) * m_local)
        out = kernel(p.x[rows], p.w1[mine].contiguous(), p.w2[mine].contiguous(), p.topk_weights[rows].contiguous(),
                     p.topk_ids[rows].contiguous(), global_num_experts=e_global, expert_map=expert_map)
        ref = moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)[rows]
        assert_close(out, ref, torch.float32, name=f"rank {rank} output")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chunk_size, routing", [(32768, "uniform"), (4, "out_of_range")])
def test_all_gather_expert_parallel_two_ranks(chunk_size, routing, monkeypatch):
    if torch.cuda.device_count() < ALL_GATHER_WORLD:  # NCCL needs a GPU per rank: else gloo on CPU
        _gloo_ranks_on_cpu(monkeypatch)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_all_gather_rank_main, args=(os.path.join(tmp, "init"), chunk_size, routing), nprocs=ALL_GATHER_WORLD, join=True)
