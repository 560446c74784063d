"""Expert-parallel benchmark: one MoE layer step per implementation (all-gather, all-to-all) with
the dispatch (prepare) and the combine (finalize) timed on their own, and the bytes each rank
moves per step against the link bandwidth.

Run with ``python -m tmoe bench-ep [--world-size W]`` (spawns W processes, one GPU each, NCCL)
or ``torchrun --nproc-per-node W -m tmoe.tools.bench_ep``. World size 1 works (the collectives
are local copies then). Every rank runs the same fixed iteration count (a timing loop that
chose its own count could leave ranks waiting on each other); a time is the median over
iterations of the slowest rank. Payload per rank per step (``act`` = activation bytes), of
which the share (W-1)/W crosses links:

* all-gather: dispatch gathers W * M * (K * act + topk * 8) (tokens, ids, weights), combine
  reduce-scatters float32 partial sums, W * M * K * 4;
* all-to-all: dispatch exchanges its E * C * (K * act + scale bytes) + 4E buffer (C = the
  capacity per (rank, expert)), combine the E * C * K * 2 bf16 outputs.

``link GB/s`` is the cross-link share / the phase's time; ``of link`` divides it by
``--link-gbps`` (per direction; 450 for H200 NVLink 4). At W = 1 nothing crosses a link.
The step time is the eager layer call (host time included), dispatch = prepare, combine = finalize.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {"qwen3": (128, 768, 2048, 8), "deepseek": (256, 2048, 7168, 8), "tiny": (8, 32, 64, 2)}  # E, N, K, topk


@dataclass(frozen=True)
class Result:
    shape: str
    m: int
    impl: str
    world: int
    step_us: float
    dispatch_us: float
    combine_us: float
    dispatch_bytes: float
    combine_bytes: float
    dropped: int


def capacity_for(m: int, e: int, topk: int, factor: float) -> int:
    """Rows per (rank, expert): ``factor`` times the mean slots per expert, at most M, at least 1."""
    return max(1, min(m, math.ceil(factor * m * topk / e)))


def payload(impl: str, m: int, e: int, k: int, topk: int, world: int, capacity: int, act_bytes: int,
            scale_cols: int) -> tuple[int, int]:
    """(dispatch, combine) bytes one rank's collectives carry per step, its own share included."""
    if impl == "allgather":
        return world * m * (k * act_bytes + topk * 8), world * m * k * 4
    return e * capacity * (k * act_bytes + 4 * scale_cols) + 4 * e, e * capacity * k * 2


def _timed(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median microseconds of ``fn`` over ``iters`` calls, the slowest rank's."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def bench_one(shape: str, m: int, impl: str, args: argparse.Namespace, device: torch.device) -> Result:
    import tmoe
    from tmoe.modular import FusedMoEQuantConfig, expert_map

    e, n, k, topk = SHAPES[shape]
    world, rank = dist.get_world_size(), dist.get_rank()
    fp8 = args.dtype == "fp8_block"
    qc = FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(128, 128)) if fp8 else FusedMoEQuantConfig()
    e_local = e // world
    g = torch.Generator(device=device).manual_seed(rank)
    w1 = torch.randn(e_local, 2 * n, k, device=device, dtype=torch.bfloat16, generator=g) / k**0.5
    w2 = torch.randn(e_local, k, n, device=device, dtype=torch.bfloat16, generator=g) / n**0.5
    scales = {}
    if fp8:
        (w1, s1), (w2, s2) = (tmoe.quantize_weight_per_block_fp8(w, (128, 128)) for w in (w1, w2))
        scales = dict(w1_scale=s1, w2_scale=s2)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
    weights, ids = torch.randn(m, e, device=device, generator=g).softmax(-1).topk(topk)
    ids = ids.to(torch.int32)
    emap = expert_map(e, world, rank, args.placement, device)
    capacity = capacity_for(m, e, topk, args.capacity_factor)
    if impl == "allgather":
        pf, experts = tmoe.AllGatherPrepareAndFinalize(), tmoe.TritonExperts(qc)
    else:
        pf = tmoe.AllToAllPrepareAndFinalize(None, m, e, capacity, args.placement)
        experts = tmoe.BatchedTritonExperts(pf.expert_capacity, qc)
    kernel = tmoe.FusedMoEModularKernel(pf, experts)
    call = dict(global_num_experts=e, expert_map=emap, **scales)
    if impl == "alltoall":
        pf.reset_dropped_slots(device)
    step_us = _timed(lambda: kernel(x, w1, w2, weights, ids, **call), args.iters, args.warmup)
    dropped = int(pf.dropped_slots(device)) // (args.iters + args.warmup) if impl == "alltoall" else 0
    prepared = pf.prepare(x, weights, ids, e, emap, False, qc)
    dispatch_us = _timed(lambda: pf.prepare(x, weights, ids, e, emap, False, qc), args.iters, args.warmup)
    rows = prepared.a1q.shape[:-1]
    fused_out = torch.randn(*rows, *(() if impl == "alltoall" else (topk,)), k, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    finalize = lambda: pf.finalize(out, fused_out, weights, ids, False, num_experts=e, expert_map=emap,  # noqa: E731
                                   prepared=prepared, num_local_experts=e_local)
    combine_us = _timed(finalize, args.iters, args.warmup)
    scale_cols = k // 128 if fp8 else 0
    d_bytes, c_bytes = payload(impl, m, e, k, topk, world, capacity, 1 if fp8 else 2, scale_cols)
    return Result(shape, m, impl, world, step_us, dispatch_us, combine_us, d_bytes, c_bytes, dropped)


def markdown(results: list[Result], link_gbps: float) -> str:
    head = ("| shape | M/rank | impl | step µs | dispatch µs | combine µs | dispatch MB | combine MB | "
            "dispatch link GB/s (of link) | combine link GB/s (of link) | dropped slots/step |")
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for r in results:
        off_rank = (r.world - 1) / r.world
        bw = [off_rank * b / (t * 1e-6) / 1e9 if t > 0 else 0.0 for b, t in ((r.dispatch_bytes, r.dispatch_us),
                                                                             (r.combine_bytes, r.combine_us))]
        cells = [r.shape, str(r.m), r.impl, f"{r.step_us:.1f}", f"{r.dispatch_us:.1f}", f"{r.combine_us:.1f}",
                 f"{r.dispatch_bytes / 1e6:.3f}", f"{r.combine_bytes / 1e6:.3f}",
                 *(f"{v:.1f} ({v / link_gbps:.0%})" for v in bw), str(r.dropped)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank()))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    lead = dist.get_rank() == 0
    if lead:  # the table's header first, then each row as it is measured: every row printed once
        print(f"world size {dist.get_world_size()}, {args.dtype}, placement {args.placement}, capacity factor "
              f"{args.capacity_factor}, link {args.link_gbps} GB/s per direction\n")
        print(markdown([], args.link_gbps), flush=True)
    for shape in args.shapes:
        for m in args.ms:
            for impl in args.impls:
                result = bench_one(shape, m, impl, args, device)
                if lead:
                    print(markdown([result], args.link_gbps).splitlines()[-1], flush=True)


def _spawned(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _run(args)
    finally:
        dist.destroy_process_group()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tmoe bench-ep", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3", "deepseek"], choices=sorted(SHAPES))
    p.add_argument("--ms", nargs="+", type=int, default=[1, 64, 1024], help="tokens per rank")
    p.add_argument("--impls", nargs="+", default=["allgather", "alltoall"], choices=["allgather", "alltoall"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp8_block"])
    p.add_argument("--placement", default="contiguous", choices=["contiguous", "round_robin"])
    p.add_argument("--capacity-factor", type=float, default=2.0,
                   help="all-to-all rows per (rank, expert) = factor * M * topk / E, in [1, M]")
    p.add_argument("--world-size", type=int, default=max(1, torch.cuda.device_count()),
                   help="processes to spawn when not started by torchrun")
    p.add_argument("--link-gbps", type=float, default=450.0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            _run(args)
        finally:
            dist.destroy_process_group()
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.world_size, os.path.join(tmp, "init"), args), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
