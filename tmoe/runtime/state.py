"""The launch caches' state, in one module: the direct-call switch, the signature tables of
``launch`` and ``planned``, the generation counter that drops recorded sequences and replays,
and the thread-local hooks through which a ``LaunchSequence`` cursor (plan.py) and a recording
``CallReplay`` (replay.py) see each launch."""
from __future__ import annotations

import threading
from typing import Any

import torch

from tmoe.runtime.interpreter import INTERPRETED

# compiled kernels are called directly only where they run: a CUDA device, not the interpreter;
# read per call, so tests and tools/host_overhead may switch it
DIRECT_CALLS = not INTERPRETED and torch.cuda.is_available()
MAX_SIGNATURES = 4096  # per kernel or launcher; the table is cleared when it fills (keys hold no tensors)

kernel_tables: dict[int, dict[tuple, Any]] = {}  # id(kernel) -> signature -> compiled (launch.py)
plan_tables: list[dict] = []  # each @planned launcher's plans (plan.py)
_local = threading.local()
_generation = [0]


def generation() -> int:
    """Bumped by ``clear_launch_caches``: what was recorded before is recorded again."""
    return _generation[0]


def recorder() -> Any:
    """The recording ``CallReplay``'s recorder on this thread, or None."""
    return getattr(_local, "recorder", None)


def set_recorder(value: Any) -> None:
    _local.recorder = value


def cursor() -> Any:
    """The active ``LaunchSequence``'s cursor on this thread, or None."""
    return getattr(_local, "cursor", None)


def set_cursor(value: Any) -> None:
    _local.cursor = value


def register_plans(plans: dict) -> None:
    """Hand a ``planned`` launcher's table to ``clear_launch_caches``."""
    plan_tables.append(plans)


def clear_launch_caches() -> None:
    """Forget every signature seen: the next launches go through Triton again (tests)."""
    kernel_tables.clear()
    for plans in plan_tables:
        plans.clear()
    _generation[0] += 1


def direct_call_count() -> int:
    """How many signatures (launch and planned) have a compiled kernel for direct calls."""
    plans = [p for table in plan_tables for p in table.values()]
    return (sum(c is not None for t in kernel_tables.values() for c in t.values())
            + sum(len(p.compiled) for p in plans))
