"""The demo behind ``python -m tmoe``: one random MoE layer run eager, compiled and (on a GPU)
as a CUDA graph, each checked against the float32 reference, with a table of error and time."""
from __future__ import annotations

import os
import time
from typing import Callable

import torch

import tmoe
from tmoe.reference import moe_reference
from tmoe.testing import capture_cuda_graph, rel_error


def _time_ms(fn: Callable[[], torch.Tensor], reps: int) -> float:
    """Median wall time of ``fn`` in ms (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def run_demo() -> None:
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    # Mixtral-8x7B on a GPU; a small layer on CPU, where Triton runs interpreted
    e, n, k, topk, m = (8, 14336, 4096, 2, 64) if gpu else (8, 128, 256, 2, 16)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=dtype)
    w1 = (torch.randn(e, 2 * n, k, device=device) / k**0.5).to(dtype)
    w2 = (torch.randn(e, k, n, device=device) / n**0.5).to(dtype)
    weights, ids = torch.topk(torch.randn(m, e, device=device).softmax(-1), topk)
    ids = ids.to(torch.int32)
    ref = moe_reference(x, w1, w2, weights, ids)
    compiled = torch.compile(tmoe.fused_experts, fullgraph=True, dynamic=True)
    modes: dict[str, Callable[[], torch.Tensor]] = {
        "eager": lambda: tmoe.fused_experts(x, w1, w2, weights, ids),
        "torch.compile(fullgraph)": lambda: compiled(x, w1, w2, weights, ids),
    }
    if gpu:
        graph, graph_out = capture_cuda_graph(modes["eager"])
        modes["cuda graph"] = lambda: (graph.replay(), graph_out)[1]
    reps = 20 if gpu else 3
    print(f"tmoe demo on {torch.cuda.get_device_name() if gpu else 'CPU (Triton interpreter)'}: "
          f"E={e} N={n} K={k} topk={topk} M={m} {str(dtype).removeprefix('torch.')}")
    print("| mode | rel. error vs fp32 reference | median time (ms) |\n|---|---|---|")
    for name, fn in modes.items():
        out = fn().clone()
        print(f"| {name} | {rel_error(out, ref):.2e} | {_time_ms(fn, reps):.3f} |", flush=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("(CPU times are the Triton interpreter's, not a kernel's)")
