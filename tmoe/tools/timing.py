"""The benchmark's measurements: the ceilings (copy and read bandwidth, bf16 and fp8 matmul rates,
each the best of several steady-state trials) and the two timers (CUDA-graph replay with events,
eager ``do_bench``), all medians."""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from tmoe.testing.graphs import capture_cuda_graph

Call = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Ceilings:
    """copy_bw (bytes read + written per s) and read_bw (bytes read per s); bf16 and fp8 matmul
    rates in FLOP/s. Each is the best of several steady-state trials, all kept in ``trials``."""

    copy_bw: float
    read_bw: float
    bf16_flops: float
    fp8_flops: float
    trials: dict[str, tuple[float, ...]]
    note: str = ""

    def rate(self, dtype: str) -> float:
        return self.fp8_flops if dtype.startswith("fp8") else self.bf16_flops

    def describe(self) -> str:
        """One line: the ceilings, then every trial (TB/s, TFLOP/s)."""
        trials = "; ".join(f"{name} " + ", ".join(f"{v / 1e12:.2f}" for v in vals) for name, vals in self.trials.items())
        return (f"copy {self.copy_bw / 1e12:.2f} TB/s, read {self.read_bw / 1e12:.2f} TB/s, bf16 matmul "
                f"{self.bf16_flops / 1e12:.0f} TFLOP/s, fp8 matmul {self.fp8_flops / 1e12:.0f} TFLOP/s ({self.note}); "
                f"best of {len(next(iter(self.trials.values())))} steady-state trials each (read: per kernel shape; "
                f"matmul rates: the best of their steady-state and burst trials), all trials: {trials}")


def time_graph(calls: Sequence[Call], min_rounds: int = 20, target_ms: float = 100.0) -> float:
    """Median µs per replay: one CUDA graph captured per call (after a side-stream warm-up),
    each round replays them all in turn; at least ``min_rounds`` rounds timed with events."""
    graphs, _outs = zip(*(capture_cuda_graph(call) for call in calls))  # outputs kept alive while replaying
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for g in graphs:
        g.replay()
    end.record()
    torch.cuda.synchronize()
    rounds = max(min_rounds, min(200, int(target_ms / max(start.elapsed_time(end), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rounds)]
    for s, e in events:
        s.record()
        for g in graphs:
            g.replay()
        e.record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in events) / len(graphs)


def time_eager(calls: Sequence[Call], rep_ms: float = 100.0) -> float:
    """Median µs of ``triton.testing.do_bench`` (L2 flushed per call), cycling over the calls."""
    import triton.testing

    it = itertools.cycle(calls)
    return 1e3 * triton.testing.do_bench(lambda: next(it)(), warmup=10, rep=rep_ms, return_mode="median")


def time_ms(step: Callable[[], object], device: torch.device, rep_ms: float) -> float:
    """The do_bench median of ``step`` in ms on CUDA; one wall-clock call elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(step, warmup=min(25.0, rep_ms), rep=rep_ms, return_mode="median")
    t0 = time.perf_counter()
    step()
    return 1e3 * (time.perf_counter() - t0)


def peak_mib(step: Callable[[], object], device: torch.device) -> float | None:
    """Peak allocated over one step above what was held before it (None on CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del res
    return peak / 2**20


def measure_ceilings(with_fp8: bool, trials: int = 5) -> Ceilings:
    """The best of ``trials`` steady-state trials (after a second of warm-up matmuls that bring the
    GPU to its working clock; each trial a do_bench median over 200 ms) of: copy bandwidth (a
    2 GiB tensor copied: bytes read + written), read bandwidth (the same tensor summed by Triton
    streaming-read kernels of ``_READ_SHAPES``, the fastest), 8192^3 matmul rates on random data.
    fp8: ``torch._scaled_mm`` with row-wise float32 scales, or 2x the bf16 rate when it fails or
    ``with_fp8`` is False. The bf16 rate is also measured in ``trials`` short bursts (ten products
    timed together after three warm-ups, from a GPU idle for a moment): the chip runs faster
    before its power limit lowers the clock under sustained load, so the ceiling is the higher of
    the two (a floor no run can beat), and both sets of trials are recorded; the fp8 rate likewise."""
    import triton.testing

    n = 8192  # the matmuls' size

    def best(fn: Call, work: float) -> tuple[float, tuple[float, ...]]:
        rates = tuple(work / (1e-3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
                      for _ in range(trials))
        return max(rates), rates

    def best_matmul(fn: Call) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
        """(rate, steady-state trials, burst trials) of an n^3 product."""
        _, steady = best(fn, 2 * n**3)
        bursts = tuple(_burst_rate(fn, 2 * n**3) for _ in range(trials))
        return max(steady + bursts), steady, bursts

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    warm_until = time.perf_counter() + 1.0
    while time.perf_counter() < warm_until:
        torch.matmul(a, b)
    torch.cuda.synchronize()
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    copy_bw, copy_trials = best(lambda: dst.copy_(src), 2 * nbytes)
    del dst
    fewest = min(block * tiles for block, tiles, _ in _READ_SHAPES)  # elements per program of the widest grid
    partials = torch.empty(triton.cdiv(src.numel(), fewest), dtype=torch.float32, device="cuda")
    read_trials = tuple(itertools.chain.from_iterable(
        best(lambda: _stream_read(src, partials, block, tiles, warps), nbytes)[1]
        for block, tiles, warps in _READ_SHAPES))
    read_bw = max(read_trials)
    del src, partials
    bf16_rate, bf16_trials, bursts = best_matmul(lambda: torch.matmul(a, b))
    fp8_rate, fp8_trials, fp8_bursts, note = 2 * bf16_rate, (), (), "fp8 rate = 2 x bf16 (not measured)"
    if with_fp8:
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
            fp8_rate, fp8_trials, fp8_bursts = best_matmul(
                lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
            note = "fp8 rate: torch._scaled_mm, row-wise scales, the best of steady-state and burst trials"
        except Exception as err:  # noqa: BLE001  (fall back, noted)
            note = f"fp8 rate = 2 x bf16 (torch._scaled_mm failed: {type(err).__name__})"
    del a, b
    torch.cuda.empty_cache()
    found = {"copy": copy_trials, "read": read_trials, "bf16": bf16_trials, "bf16 burst": bursts, "fp8": fp8_trials,
             "fp8 burst": fp8_bursts}
    return Ceilings(copy_bw, read_bw, bf16_rate, fp8_rate, {k: v for k, v in found.items() if v}, note)


def _burst_rate(fn: Call, work: float, idle_s: float = 0.5, warmup: int = 3, timed: int = 10) -> float:
    """``work`` per second of ``timed`` back-to-back calls of ``fn`` (one pair of events around
    them), after ``idle_s`` of idle GPU and ``warmup`` calls: the rate before the power limit bites."""
    torch.cuda.synchronize()
    time.sleep(idle_s)
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(timed):
        fn()
    end.record()
    torch.cuda.synchronize()
    return timed * work / (1e-3 * start.elapsed_time(end))


# (BLOCK, TILES, num_warps) of the read-bandwidth kernels tried: each program reads TILES blocks of BLOCK
# elements; the widest one-block programs were fastest, so wider ones, more loads in flight, follow
_READ_SHAPES = ((4096, 16, 8), (8192, 4, 8), (16384, 1, 8), (32768, 1, 16), (65536, 1, 32))


@triton.jit
def _stream_read_kernel(x_ptr, partial_ptr, numel, BLOCK: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for t in tl.static_range(TILES):
        offs = (pid * TILES + t) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < numel, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def _stream_read(x: torch.Tensor, partials: torch.Tensor, block: int, tiles: int, num_warps: int = 8) -> None:
    """Read every element of ``x`` once: cdiv(numel, block * tiles) programs of ``num_warps`` warps,
    each summing ``tiles`` blocks of ``block`` elements into its entry of ``partials`` (at least
    that many elements)."""
    grid = triton.cdiv(x.numel(), block * tiles)
    _stream_read_kernel[(grid,)](x, partials, x.numel(), BLOCK=block, TILES=tiles, num_warps=num_warps)
