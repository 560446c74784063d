"""Programmatic dependent launch (PDL): the switch, the launch arguments and the jit helpers of
the decode-path kernels (align, expert GEMMs, down+reduce, reduce, fp8 activation quant).

A kernel launched with ``launch_pdl=True`` may start once every program of the kernel before it
in the stream has called ``gdc_launch_dependents`` or exited (Hopper and later). Each such
kernel (``USE_PDL``) calls ``pdl_wait`` (``gdc_wait``: the previous kernel has finished, its
writes visible) at its start, before it reads or writes anything, and ``pdl_launch_dependents``
after its main loop (the GEMMs: after the K loop, before the epilogue), so the next kernel's
programs become resident only while this one drains and take no SM slots from its later waves
(triggering right after the wait was slower where grids run several waves: docs/runtime.md).

Off by default (``TMOE_PDL=1`` in the environment at import turns it on); ``override_pdl``
switches it for a block. Never on under the interpreter or below compute capability 9.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import triton
import triton.language as tl

from tmoe.runtime.interpreter import INTERPRETED

PDL_DEFAULT = os.environ.get("TMOE_PDL", "0") == "1"

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


def pdl_args() -> dict[str, bool]:
    """Keyword arguments for a launch of a kernel with a ``USE_PDL`` constexpr: ``USE_PDL`` and
    the launch option ``launch_pdl`` when the switch is on and the current device takes PDL; else
    ``USE_PDL=False`` alone (the launch as without PDL)."""
    if not pdl_requested() or INTERPRETED:
        return {"USE_PDL": False}
    from triton.runtime.driver import driver

    if not _capable(driver.active.get_current_device()):
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel has finished (its writes visible, its reads done). Every
    program of a USE_PDL kernel calls it first."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel start (it waits in turn before it touches memory). Called after
    ``pdl_wait`` once the program's main loop is done; a program that returns before it counts as
    having called it."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
