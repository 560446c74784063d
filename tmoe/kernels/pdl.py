"""Programmatic dependent launch (PDL): the switch and the launch arguments of the decode-path kernels.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream
drains (Hopper and later). Each such kernel (``USE_PDL``) calls ``tl.extra.cuda.gdc_wait()``
before it reads anything the previous kernel writes and before its first store (the previous
kernel may still read the memory), then ``gdc_launch_dependents()`` so the next kernel can
start. Since every kernel triggers its dependents only after its own wait, data written two or
more launches back (the align outputs, as the down GEMM sees them; the router's ``topk_ids``,
as the down GEMMs see them) is complete when a kernel starts: those loads may come before the
wait. Weights are never written inside the layer.

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

from tmoe.kernels.interpreter import INTERPRETED

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
    the launch option ``launch_pdl`` when the switch is on and the current device takes PDL;
    else ``USE_PDL=False`` alone (the launch as without PDL)."""
    if not pdl_requested() or INTERPRETED:
        return {"USE_PDL": False}
    from triton.runtime.driver import driver

    if not _capable(driver.active.get_current_device()):
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel has finished (its writes visible, its reads done), then let
    the next kernel start (it waits in turn). Every program of a USE_PDL kernel calls it before its
    first store and before it reads what the previous kernel writes, early return included."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
