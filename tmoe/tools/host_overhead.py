"""Host-side (Python) time of one ``tmoe.fused_experts`` call with the Triton launches stubbed
out, on CPU: what tmoe's own checks, config lookup and allocation cost per eager call, apart
from Triton's launch path and the kernels. ``python -m tmoe.tools.host_overhead [--profile]``"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

import tmoe


def main(profile: bool = False, reps: int = 200, trials_count: int = 10) -> float:
    from triton.runtime.interpreter import InterpretedFunction

    InterpretedFunction.run = lambda self, *args, **kwargs: None  # no kernel work: measure tmoe's Python only
    m, e, n, k, topk = 1, 128, 768, 2048, 8  # Qwen3-30B-A3B decode
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w1, w2 = torch.randn(e, 2 * n, k, dtype=torch.bfloat16), torch.randn(e, k, n, dtype=torch.bfloat16)
    weights, ids = torch.topk(torch.randn(m, e).softmax(-1), topk)
    ids = ids.int()
    for _ in range(20):
        tmoe.fused_experts(x, w1, w2, weights, ids)
    trials = []
    for _ in range(trials_count):  # the best trial: the machine's other load only ever adds time
        t0 = time.perf_counter()
        for _ in range(reps):
            tmoe.fused_experts(x, w1, w2, weights, ids)
        trials.append((time.perf_counter() - t0) / reps * 1e6)
    us = min(trials)
    print(f"fused_experts host time (launches stubbed, Qwen3-30B-A3B M=1, best of {trials_count} x {reps} calls): "
          f"{us:.1f} us/call")
    if profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [tmoe.fused_experts(x, w1, w2, weights, ids) for _ in range(200)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return us


if __name__ == "__main__":
    if torch.cuda.is_available():
        sys.exit("run this on a CPU-only machine: it stubs the Triton interpreter's launches")
    main(profile="--profile" in sys.argv)
