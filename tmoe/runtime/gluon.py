"""Where the Gluon engine runs: an sm_90 GPU (Hopper: wgmma and TMA; not the interpreter, not other
architectures) with a Triton whose Gluon API tmoe's engine compiles with (3.6 through 3.9), read
once per device index. By default it runs the grouped up GEMM of at least
``DEFAULT_MIN_ROWS_PER_EXPERT`` routed rows per expert, where it measured faster than the ``tl`` core
(H100: 1.13-1.18x at Mixtral-8x7B M = 1024 and 4096, 256 and 1024 rows per expert; 1.17x at
Qwen3-30B-A3B M = 4096, 256 rows), and not below (H100, DeepSeek-V3 M = 4096, 128 rows per expert,
the only DeepSeek-V3 cell on the grouped core: the layer took 12.3 ms with the engine's up GEMM
against 10.0-10.2 ms with the ``tl`` core's in earlier runs), nor the down GEMM, where it measured
slower but at Mixtral M = 1024 (0.72-0.96x; ``python bench/repro_gluon_grouped.py``,
``bench/results/gluon_grouped.csv``). ``TMOE_GLUON=1`` or ``override_engine("gluon")`` run every
grouped GEMM on it, fp8 ones too (correct on the GPU, not yet timed against the ``tl`` core, so not
the default) and the input gradient's GEMM ("dx", ``gluon_grad_input``); ``TMOE_GLUON=0`` or
``override_engine("tl")`` none."""
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
DEFAULT_MIN_ROWS_PER_EXPERT = 256  # ... at this many routed rows per expert and more


def gluon_ready(device: torch.device, gemm: str, rows_per_expert: float) -> bool:
    """The Gluon engine can run on ``device`` and is wanted for grouped GEMM ``gemm``: "up" or
    "down" with float operands, "up.fp8" or "down.fp8" with fp8 ones, "dx" the input gradient's;
    ``rows_per_expert``: the call's routed rows (slots) over its experts (see the module docstring)."""
    asked = _OVERRIDE[-1] if _OVERRIDE else {"1": "gluon", "0": "tl"}.get(os.environ.get("TMOE_GLUON", ""))
    by_default = gemm in DEFAULT_GEMMS and rows_per_expert >= DEFAULT_MIN_ROWS_PER_EXPERT
    if asked == "tl" or (asked is None and not by_default):
        return False
    if INTERPRETED or device.type != "cuda":
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())
