"""Host-side (Python) time of one ``tmoe.fused_experts`` call with the kernel launches stubbed
out, on CPU: what tmoe's own checks, plans, allocation and launch calls cost per eager call.

``python -m tmoe.tools.host_overhead [--profile] [--path gpu|interpreter]``. Two paths:
- ``gpu`` (default): the path a CUDA device takes, simulated on CPU (Triton's JIT is not put in
  interpreter mode; compiled kernels are called directly, as on a GPU, and their launch, the C
  launcher Triton provides, is a no-op);
- ``interpreter``: the CPU path (Triton's interpreter, its kernel run a no-op; includes the
  interpreter workarounds' swap, which a GPU does not have).
Without ``--path`` both run, each in its own process."""
from __future__ import annotations

import cProfile
import os
import pstats
import subprocess
import sys
import time

import torch


class _StubCompiled:
    """A compiled kernel whose launch does nothing (Triton's C launcher, stubbed)."""

    function = packed_metadata = None

    @staticmethod
    def run(*args) -> None:
        return None


def _stub_gpu_path() -> None:
    from triton.runtime.jit import JITFunction

    from tmoe.runtime import state

    JITFunction.run = lambda self, *args, **kwargs: _StubCompiled()  # Triton's binder and compile, stubbed
    state.DIRECT_CALLS = True
    torch._C._cuda_getDevice = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    torch.cuda.is_current_stream_capturing = lambda: False


def _stub_interpreter_path() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    InterpretedFunction.run = lambda self, *args, **kwargs: None


def measure(path: str, profile: bool = False, reps: int = 200, trials_count: int = 10) -> float:
    import tmoe
    from tmoe.runtime.interpreter import INTERPRETED

    if INTERPRETED != (path == "interpreter"):
        sys.exit(f"the {path} path needs TRITON_INTERPRET={int(path == 'interpreter')} before tmoe is imported")
    (_stub_interpreter_path if path == "interpreter" else _stub_gpu_path)()
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
    print(f"fused_experts host time, {path} path (launches stubbed, Qwen3-30B-A3B M=1, best of {trials_count} x "
          f"{reps} calls): {us:.1f} us/call")
    if profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [tmoe.fused_experts(x, w1, w2, weights, ids) for _ in range(200)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return us


def main(argv: list[str]) -> None:
    if torch.cuda.is_available():
        sys.exit("run this on a CPU-only machine: it stubs the kernel launches")
    profile = "--profile" in argv
    if "--path" in argv:
        measure(argv[argv.index("--path") + 1], profile)
        return
    for path in ("gpu", "interpreter"):
        env = {**os.environ, "TRITON_INTERPRET": "1" if path == "interpreter" else "0"}
        cmd = [sys.executable, "-m", "tmoe.tools.host_overhead", "--path", path] + (["--profile"] if profile else [])
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
