"""Hypothesis strategies for MoE problems: shapes from a few buckets (so Triton kernels do not
recompile per example), dtypes, and routings (uniform, skewed, one-hot, empty experts,
out-of-range ids). Needs ``hypothesis``."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st

ROUTINGS = ("uniform", "skewed", "one_hot", "empty_experts", "out_of_range")


@dataclass(frozen=True)
class MoEShape:
    m: int
    e: int
    n: int
    k: int
    topk: int


DECODE_MAX_M = 8
"""The largest M the route matrices run a decode route at (see ``route_shape``)."""


def route_shape(shape: MoEShape, route: str) -> MoEShape:
    """``shape`` as a test runs it under a forced ``route``: the decode routes (direct, slots, fused:
    one program per slot, the default only at a few tokens) run its E, N, K and topk at M <= 8 (the
    interpreter's time grows with the slots, and more of them exercise nothing more of a per-slot
    program); the aligned route ("sorted") runs M as given (several row blocks per expert)."""
    return shape if route == "sorted" or shape.m <= DECODE_MAX_M else replace(shape, m=DECODE_MAX_M)


@dataclass(frozen=True)
class MoEProblem:
    """Tensors of one layer call: x (M, K), w1 (E, 2N, K), w2 (E, K, N), weights (M, topk)
    float32, ids (M, topk) int32."""

    shape: MoEShape
    routing: str
    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


def shapes(
    ms: tuple[int, ...] = (0, 1, 3, 17, 64),
    experts: tuple[int, ...] = (1, 4, 8),
    nk: tuple[tuple[int, int], ...] = ((64, 64), (100, 72)),
    topks: tuple[int, ...] = (1, 2),
) -> st.SearchStrategy[MoEShape]:
    """Shapes from buckets; topk is capped at E."""

    @st.composite
    def draw(d):
        e = d(st.sampled_from(experts))
        n, k = d(st.sampled_from(nk))
        return MoEShape(d(st.sampled_from(ms)), e, n, k, min(d(st.sampled_from(topks)), e))

    return draw()


def routing_ids(m: int, e: int, topk: int, routing: str, generator: torch.Generator) -> torch.Tensor:
    """(m, topk) int32 expert ids under a named routing pattern (distinct per row unless out_of_range)."""
    if routing == "one_hot":  # every token on the same experts
        return torch.arange(topk, dtype=torch.int32).repeat(m, 1).reshape(m, topk)
    scores = torch.rand(m, e, generator=generator)
    if routing == "skewed":
        scores = scores * torch.linspace(0.05, 1.0, e) ** 4
    if routing == "empty_experts" and e > topk:
        scores[:, : max(1, (e - topk) // 2)] = -1.0  # these experts receive nothing
    ids = torch.topk(scores, topk, dim=-1).indices.to(torch.int32)
    if routing == "out_of_range" and m > 0:
        bad = torch.rand(m, topk, generator=generator) < 0.3
        ids = torch.where(bad, torch.where(torch.rand(m, topk, generator=generator) < 0.5, -1, e), ids)
    return ids.to(torch.int32).reshape(m, topk)


def half_remote_expert_map(e: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """(e,) int32 expert_map of a rank holding the even experts (local ids 0, 1, ...); odd ones are remote."""
    ids = torch.arange(e)
    return torch.where(ids % 2 == 0, ids // 2, -1).to(torch.int32).to(device)


def half_remote_swigluoai(p, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(w1, w2, layer keyword arguments) of the rank holding the even experts of problem ``p``:
    its local weights, GPT-OSS's swigluoai with random biases of both GEMMs, and the expert map."""
    e = p.w1.shape[0]
    emap = half_remote_expert_map(e, device)
    local = torch.arange(e, device=device)[emap >= 0]
    w1, w2 = p.w1[local].contiguous(), p.w2[local].contiguous()
    b1 = torch.randn(len(local), w1.shape[1], device=device).to(p.x.dtype)
    b2 = torch.randn(len(local), w2.shape[1], device=device).to(p.x.dtype)
    return w1, w2, dict(activation="swigluoai", w1_bias=b1, w2_bias=b2, global_num_experts=e, expert_map=emap)


def make_problem(shape: MoEShape, dtype: torch.dtype, routing: str, seed: int, device: str | torch.device = "cpu"):
    """Random layer inputs with weights scaled so outputs stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    m, e, n, k, topk = shape.m, shape.e, shape.n, shape.k, shape.topk
    x = torch.randn(m, k, generator=g)
    w1 = torch.randn(e, 2 * n, k, generator=g) / k**0.5
    w2 = torch.randn(e, k, n, generator=g) / n**0.5
    weights = torch.rand(m, topk, generator=g)
    weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-6)
    ids = routing_ids(m, e, topk, routing, g)
    to = dict(device=device)
    return MoEProblem(shape, routing, x.to(dtype=dtype, **to), w1.to(dtype=dtype, **to), w2.to(dtype=dtype, **to),
                      weights.to(**to), ids.to(**to))


def problems(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), device="cpu",
             **shape_kwargs) -> st.SearchStrategy[MoEProblem]:
    """Whole problems: a bucketed shape, a dtype, a routing pattern and a seed."""
    return st.builds(
        make_problem, shapes(**shape_kwargs), st.sampled_from(dtypes), st.sampled_from(ROUTINGS),
        st.integers(0, 2**31 - 1), st.just(device),
    )
