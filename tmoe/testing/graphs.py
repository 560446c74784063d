"""CUDA-graph capture the way the suite, the demo and the benchmark do it."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture_cuda_graph(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``fn`` once on a side stream (compiles kernels, settles allocations), then capture one
    call. Returns the graph and that call's outputs, which every ``graph.replay()`` rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
