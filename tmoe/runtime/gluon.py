"""Where the Gluon engine runs: an sm_90 GPU (Hopper: wgmma and TMA; not the interpreter, not other
architectures) with a Triton whose Gluon API tmoe's engine compiles with (3.6 through 3.9), read
once per device index. By default it runs the grouped up GEMM, where it measured faster than the
``tl`` core (H100: 1.13-1.18x at Mixtral-8x7B M = 1024 and 4096, 1.17x at Qwen3-30B-A3B M = 4096),
and not the down GEMM, where it measured slower but at Mixtral M = 1024 (0.72-0.96x;
``python bench/repro_gluon_grouped.py``, ``bench/results/gluon_grouped.csv``). ``TMOE_GLUON=1`` or
``override_engine("gluon")`` run both GEMMs on it, fp8 ones too (correct on the GPU, not yet timed
against the ``tl`` core, so not the default) and the input gradient's GEMM ("dx", ``gluon_grad_input``);
``TMOE_GLUON=0`` or ``override_engine("tl")`` none."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch

from tmoe.runtime.interpreter import INTERPRETED

ENGINES = ("gluon", "tl")
_OVERRIDE: list[str] = []


@contextlib.contextmanager
def override_engine(engine: str) -> Iterator[None]:
    """Within the block, the grouped GEMMs run on ``engine`` ("gluon" where it can run, else "tl")."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    _OVERRIDE.append(engine)
    try:
        yield
    finally:
        _OVERRIDE.pop()


@functools.cache
def _hopper(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) == (9, 0)


DEFAULT_GEMMS = ("up", )  # the GEMMs the engine runs unless told otherwise: measured faster (bf16; fp8 not yet timed)


def gluon_ready(device: torch.device, gemm: str) -> bool:
    """The Gluon engine can run on ``device`` and is wanted for grouped GEMM ``gemm``: "up" or
    "down" with float operands, "up.fp8" or "down.fp8" with fp8 ones, "dx" the input gradient's
    (see the module docstring)."""
    asked = _OVERRIDE[-1] if _OVERRIDE else {"1": "gluon", "0": "tl"}.get(os.environ.get("TMOE_GLUON", ""))
    if asked == "tl" or (asked is None and gemm not in DEFAULT_GEMMS):
        return False
    if INTERPRETED or device.type != "cuda":
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())
