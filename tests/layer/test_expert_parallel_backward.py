"""The all-gather and all-to-all expert parallelism's backward with gloo at world size 2 on CPU: every rank's
gradients (its tokens' x and router weights, its local experts' weights and biases) against the
float64 reference over all experts in one process. Inside the spawned ranks ``torch.empty`` is
NaN-poisoned as in conftest, so an unwritten row shows up."""
from __future__ import annotations

import os
import pickle
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tmoe
from tmoe.modular.placement import expert_map, shard_experts
from tmoe.testing import assert_close
from tmoe.testing.gradients import layer_grads, reference_grads
from tmoe.testing.tolerance import Tolerance

E, N, K, TOPK, M_PER_RANK, WORLD = 4, 24, 40, 2, 5, 2
CASES = {"silu": dict(activation="silu"),
         "swigluoai-interleaved-bias": dict(activation="swigluoai", gate_up_interleaved=True, bias=True),
         "round-robin-out-of-range": dict(activation="gelu", placement="round_robin", out_of_range=True)}


def _problem(case: dict, seed: int, tokens: tuple[int, ...] = (M_PER_RANK,) * WORLD) -> dict:
    """Every rank's tokens stacked (rank r's are ``tokens[r]`` rows), all E experts' weights."""
    g = torch.Generator().manual_seed(seed)
    m = sum(tokens)
    ids = torch.rand(m, E, generator=g).topk(TOPK, dim=-1).indices.to(torch.int32)
    if case.get("out_of_range"):
        ids[1, 0], ids[tokens[0] + 2, 1] = E, -1
    p = dict(hidden_states=torch.randn(m, K, generator=g), w1=torch.randn(E, 2 * N, K, generator=g) / K**0.5,
             w2=torch.randn(E, K, N, generator=g) / N**0.5, topk_weights=torch.rand(m, TOPK, generator=g),
             topk_ids=ids, grad_out=torch.randn(m, K, generator=g))
    if case.get("bias"):
        p.update(w1_bias=0.3 * torch.randn(E, 2 * N, generator=g), w2_bias=0.3 * torch.randn(E, K, generator=g))
    return p


def _rank_inputs(p: dict, rows: slice, world: int, rank: int, placement: str) -> dict:
    """Rank ``rank``'s tokens and its shard of the experts, floating ones requiring grad."""
    inputs = {n: p[n][rows] for n in ("hidden_states", "topk_weights", "topk_ids")}
    for n in ("w1", "w2", "w1_bias", "w2_bias"):
        inputs[n] = shard_experts(p.get(n), world, rank, placement)
    for t in inputs.values():
        if t is not None and t.is_floating_point():
            t.requires_grad_()
    return inputs


def _init_rank(rank: int, world: int, init_file: str) -> None:
    """NaN-poisoned torch.empty (as in conftest) and the gloo group."""
    from tmoe.testing import poison

    real_empty = torch.empty
    torch.empty = lambda *a, **kw: poison(real_empty(*a, **kw))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _spawn(main) -> list[dict]:
    """Run ``main(rank, world, init_file, out_file)`` on WORLD processes; each rank's pickled results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grads")
        mp.spawn(main, args=(WORLD, os.path.join(tmp, "init"), out), nprocs=WORLD, join=True)
        results = []
        for rank in range(WORLD):
            with open(f"{out}.{rank}", "rb") as f:
                results.append(pickle.load(f))
        return results


def _check_rank_grads(rank_results: list[dict], name: str, ref: dict, rows_of, placement: str) -> None:
    """Each rank's gradients: its tokens' rows of the reference's, its experts' shard."""
    tol = Tolerance(rel=1e-5, atol=1e-5, rtol=1e-3)
    for rank, results in enumerate(rank_results):
        rows = rows_of(rank)
        for n, g in results[name].items():
            want = ref[n][rows] if n in ("hidden_states", "topk_weights") else shard_experts(ref[n], WORLD, rank,
                                                                                               placement)
            assert_close(g, want, tol, name=f"rank {rank} d{n}")


def _rank_main(rank: int, world: int, init_file: str, out_file: str) -> None:
    _init_rank(rank, world, init_file)
    layer = tmoe.FusedMoEModularKernel(tmoe.AllGatherPrepareAndFinalize(), tmoe.TritonExperts())
    results = {}
    for i, (name, case) in enumerate(CASES.items()):
        p = _problem(case, seed=i)
        placement = case.get("placement", "contiguous")
        rows = slice(rank * M_PER_RANK, (rank + 1) * M_PER_RANK)
        inputs = _rank_inputs(p, rows, world, rank, placement)
        opts = dict(activation=case["activation"], gate_up_interleaved=case.get("gate_up_interleaved", False),
                    global_num_experts=E, expert_map=expert_map(E, world, rank, placement))
        results[name] = {n: g.detach() for n, g in layer_grads(layer, inputs, p["grad_out"][rows], **opts).items()}
    with open(f"{out_file}.{rank}", "wb") as f:
        pickle.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results():
    return _spawn(_rank_main)


def _reference(p: dict, topk_ids: torch.Tensor, **options) -> dict:
    """float64 autograd gradients of the whole layer (all experts, every rank's tokens)."""
    inputs = {n: p.get(n) for n in ("hidden_states", "w1", "w2", "topk_weights", "w1_bias", "w2_bias")}
    inputs["topk_ids"] = topk_ids
    for t in inputs.values():
        if t is not None and t.is_floating_point():
            t.requires_grad_()
    return reference_grads(inputs, p["grad_out"], **options)


@pytest.mark.parametrize("name", list(CASES))
def test_allgather_gradients_match_single_process_reference(rank_results, name):
    case = CASES[name]
    p = _problem(case, seed=list(CASES).index(name))
    ref = _reference(p, p["topk_ids"], activation=case["activation"],
                     gate_up_interleaved=case.get("gate_up_interleaved", False))
    _check_rank_grads(rank_results, name, ref, lambda rank: slice(rank * M_PER_RANK, (rank + 1) * M_PER_RANK),
                      case.get("placement", "contiguous"))


# all-to-all: rank r passes TOKENS[r] tokens (at most MAX_TOKENS); a capacity of 2 rows per
# (rank, expert) drops slots, which take no gradient
TOKENS, MAX_TOKENS, CAPACITY = (6, 3), 6, 2
A2A_CASES = {"silu-drops": dict(activation="silu"),
             "round-robin-bias-drops": dict(activation="gelu", placement="round_robin", bias=True, out_of_range=True),
             "no-drops": dict(activation="silu", capacity=MAX_TOKENS)}


def _rank_rows(rank: int) -> slice:
    start = sum(TOKENS[:rank])
    return slice(start, start + TOKENS[rank])


def _kept(ids: torch.Tensor, capacity: int) -> torch.Tensor:
    """The routing with the slots the dispatch drops set to -1, by hand: per source rank and
    expert, the first ``capacity`` slots in token-major order are kept."""
    out = ids.clone()
    for rank in range(WORLD):
        seen: dict[int, int] = {}
        for t in range(_rank_rows(rank).start, _rank_rows(rank).stop):
            for k in range(TOPK):
                e = int(ids[t, k])
                if 0 <= e < E:
                    seen[e] = seen.get(e, 0) + 1
                    if seen[e] > capacity:
                        out[t, k] = -1
    return out


def _a2a_rank_main(rank: int, world: int, init_file: str, out_file: str) -> None:
    _init_rank(rank, world, init_file)
    results = {}
    for i, (name, case) in enumerate(A2A_CASES.items()):
        p = _problem(case, seed=100 + i, tokens=TOKENS)
        placement = case.get("placement", "contiguous")
        pf = tmoe.AllToAllPrepareAndFinalize(None, MAX_TOKENS, E, case.get("capacity", CAPACITY), placement)
        layer = tmoe.FusedMoEModularKernel(pf, tmoe.BatchedTritonExperts(pf.expert_capacity))
        rows = _rank_rows(rank)
        inputs = _rank_inputs(p, rows, world, rank, placement)
        opts = dict(activation=case["activation"], global_num_experts=E, expert_map=expert_map(E, world, rank, placement))
        results[name] = {n: g.detach() for n, g in layer_grads(layer, inputs, p["grad_out"][rows], **opts).items()}
    with open(f"{out_file}.{rank}", "wb") as f:
        pickle.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def a2a_rank_results():
    return _spawn(_a2a_rank_main)


@pytest.mark.parametrize("name", list(A2A_CASES))
def test_alltoall_gradients_match_single_process_reference(a2a_rank_results, name):
    """Each rank's gradients equal the float64 reference of the layer without the dropped slots
    (their router weights' gradient exactly zero), uneven token counts per rank included."""
    case = A2A_CASES[name]
    p = _problem(case, seed=100 + list(A2A_CASES).index(name), tokens=TOKENS)
    kept = _kept(p["topk_ids"], case.get("capacity", CAPACITY))
    assert (kept != p["topk_ids"]).any() == (name != "no-drops")
    ref = _reference(p, kept, activation=case["activation"])
    _check_rank_grads(a2a_rank_results, name, ref, _rank_rows, case.get("placement", "contiguous"))
    dropped = (kept == -1) & (p["topk_ids"] != -1)
    for rank, results in enumerate(a2a_rank_results):
        assert torch.all(results[name]["topk_weights"][dropped[_rank_rows(rank)]] == 0)
