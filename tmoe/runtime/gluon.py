"""Where the Gluon engine runs: an sm_90 GPU (Hopper: wgmma and TMA; not the interpreter, not other
architectures) with a Triton whose Gluon API tmoe's engine compiles with (3.6 through 3.9), read
once per device index, when asked for: ``TMOE_GLUON=1`` or ``override_engine("gluon")``. It is not
the default yet: the ``tl`` kernels stay the default until the engine has been measured faster on
the GPU (docs/routes.md); ``override_engine("tl")`` keeps them inside a block whatever the
environment says."""
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


def gluon_ready(device: torch.device) -> bool:
    """The Gluon engine can run on ``device`` and is wanted (see the module docstring)."""
    wanted = _OVERRIDE[-1] == "gluon" if _OVERRIDE else os.environ.get("TMOE_GLUON", "0") == "1"
    if not wanted:
        return False
    if INTERPRETED or device.type != "cuda":
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())
