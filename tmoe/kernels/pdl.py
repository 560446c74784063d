"""Programmatic dependent launch (PDL): the switch, the launch arguments and the jit helpers of
the decode-path kernels (align, expert GEMMs, down+reduce, reduce, fp8 activation quant).

A kernel launched with ``launch_pdl=True`` may start once every program of the kernel before it
in the stream has called ``gdc_launch_dependents`` or exited (Hopper and later). Each such
kernel (``USE_PDL``) calls ``pdl_wait`` (``gdc_wait``: the previous kernel has finished, its
writes visible) before it reads anything the previous kernel writes and before its first store
(the previous kernel may still read that memory), and ``pdl_launch_dependents`` after its main
loop (the GEMMs: after the K loop, before the epilogue), so the next kernel's programs become
resident only while this one drains and do not take SM slots from its later waves. Every
program waits before it triggers or exits, so a kernel's dependents start only after it has
waited: data written two or more launches back is complete when a kernel starts. The down GEMMs
rely on it: they read their routing (the align outputs, ``topk_ids``: written before the up GEMM
ran) and prefetch their first weight tiles into L2 (``prefetch_expert_l2``, a hint) before they
wait for the up GEMM. So with PDL on, a down GEMM must follow the up GEMM (or another kernel)
that follows whatever wrote its routing, as in every tmoe layer.

Off by default (``TMOE_PDL=1`` in the environment at import turns it on); ``override_pdl``
switches it for a block. Never on under the interpreter or below compute capability 9.
``EARLY_TRIGGER`` (measurement knob) moves the trigger to right after the wait, at the start.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import triton
import triton.language as tl

from tmoe.kernels.interpreter import INTERPRETED

PDL_DEFAULT = os.environ.get("TMOE_PDL", "0") == "1"
# with PDL, the down GEMMs prefetch their first weight tiles into L2 while they wait (with the
# early trigger on the H200: within 1.5% of no prefetch; launch plans and call replays made
# before a change keep the old value: clear_launch_caches)
PREFETCH_WEIGHTS = True
# trigger the next kernel right after the wait instead of after the main loop: the first PDL
# version, up to 54% slower than no PDL on the H200 where grids run several waves (Mixtral fp8
# block, the direct route); kept to measure against the late trigger (launch plans: as above)
EARLY_TRIGGER = False

# USE_PDL values: off, on with the trigger after the main loop, on with the trigger at the start
OFF: tl.constexpr = tl.constexpr(0)
LATE: tl.constexpr = tl.constexpr(1)
EARLY: tl.constexpr = tl.constexpr(2)

_OVERRIDE: list[bool] = []


@contextlib.contextmanager
def override_pdl(on: bool) -> Iterator[None]:
    """Launch the decode-path kernels with (``on``) or without PDL inside the block (benchmarks, tests)."""
    if not isinstance(on, bool):
        raise TypeError(f"override_pdl takes a bool, got {on!r}")
    _OVERRIDE.append(on)
    try:
        yield
    finally:
        _OVERRIDE.pop()


def pdl_requested() -> bool:
    """The switch: the innermost ``override_pdl``, else ``TMOE_PDL``."""
    return _OVERRIDE[-1] if _OVERRIDE else PDL_DEFAULT


@functools.cache
def _capable(device: int) -> bool:
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    return target.backend == "cuda" and target.arch >= 90


def pdl_args() -> dict[str, int | bool]:
    """Keyword arguments for a launch of a kernel with a ``USE_PDL`` constexpr: ``USE_PDL`` (LATE,
    or EARLY with ``EARLY_TRIGGER``) and the launch option ``launch_pdl`` when the switch is on and
    the current device takes PDL; else ``USE_PDL=OFF`` alone (the launch as without PDL)."""
    if not pdl_requested() or INTERPRETED:
        return {"USE_PDL": OFF.value}
    from triton.runtime.driver import driver

    if not _capable(driver.active.get_current_device()):
        return {"USE_PDL": OFF.value}
    return {"USE_PDL": (EARLY if EARLY_TRIGGER else LATE).value, "launch_pdl": True}


def prefetch_weights(pdl: dict[str, int | bool]) -> bool:
    """Whether a down GEMM launched with ``pdl`` (``pdl_args()``) prefetches its first weight tiles."""
    return pdl["USE_PDL"] != OFF.value and PREFETCH_WEIGHTS


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel has finished (its writes visible, its reads done); EARLY:
    then let the next kernel start. Every program of a USE_PDL kernel calls it before its first
    store, before it reads what the previous kernel writes and before any early return."""
    if USE_PDL != OFF:
        tl.extra.cuda.gdc_wait()
    if USE_PDL == EARLY:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """LATE: let the next kernel start (it waits in turn before it reads what this one writes).
    Called after ``pdl_wait`` once the program's main loop is done; a program that returns before
    it counts as having called it."""
    if USE_PDL == LATE:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_expert_l2(w_ptr, expert, offs_n, N, K, stride_we, stride_wn, stride_wk, BLOCK_K: tl.constexpr):
    """Hint L2 to fetch the first two BLOCK_K tiles along K of rows ``offs_n`` [BN] of ``expert``'s
    weights in w (E, N, K), the tiles a GEMM streams first, while it waits (nothing when expert < 0).
    One ``prefetch.global.L2`` per 128-byte line (when ``stride_wk`` is 1); no result."""
    if expert >= 0:
        rows = w_ptr + expert.to(tl.int64) * stride_we + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn  # [BN]
        LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128 bytes
        STEP: tl.constexpr = LINE if LINE < BLOCK_K else BLOCK_K
        offs_k = tl.minimum(tl.arange(0, 2 * BLOCK_K // STEP) * STEP, K - 1).to(tl.int64)  # [2BK / STEP]
        ptrs = rows[None, :] + offs_k[:, None] * stride_wk  # [2BK / STEP, BN]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
