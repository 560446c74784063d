"""Kernel launches with less host time: the direct call of a compiled kernel, and the launch caches.

``launch(kernel, grid, *args, **kwargs)`` is ``kernel[grid](*args, **kwargs)``, but after the first
launch of an argument signature it calls the compiled kernel directly, skipping Triton's per-call
binding, specialization and cache-key string (measured on the H200 host, Triton 3.6, a 61-argument
GEMM: 62 µs through ``kernel[grid]``, 12 µs for the direct call). The signature is what Triton
specializes on, taken exactly: each tensor's dtype and whether its address is 16-byte aligned,
every other argument's value (ints, floats, constexprs, launch options), the argument names and
the current device. Equal signatures compile to the same kernel, so the direct call runs exactly
what ``kernel[grid]`` would.

This module also holds what the layers above share: the signature tables (``planned`` launchers
of ``tmoe.kernels.plan`` register theirs here), ``clear_launch_caches``, the generation counter
that drops recorded sequences and replays, and the thread-local state through which a recording
``CallReplay`` (``tmoe.kernels.replay``) sees each launch.

Triton's own path is kept under the interpreter, without a CUDA device, with a launch hook
installed (profilers), and for tensor-descriptor arguments (the caller launches those itself)."""
from __future__ import annotations

import threading
from typing import Any

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from tmoe.kernels.interpreter import INTERPRETED

# compiled kernels are called directly only where they run: a CUDA device, not the interpreter
DIRECT_CALLS = not INTERPRETED and torch.cuda.is_available()
MAX_SIGNATURES = 4096  # per kernel or launcher; the table is cleared when it fills (keys hold no tensors)
_Tensor = torch.Tensor


class _Compiled:
    """A compiled kernel and where each of its parameters sits in a call's values."""

    __slots__ = ("run", "function", "metadata", "order")

    def __init__(self, kernel: Any, order: tuple[int, ...]) -> None:
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            kernel = kernel.result()
        self.run, self.function, self.metadata, self.order = kernel.run, kernel.function, kernel.packed_metadata, order

    def __call__(self, grid: tuple[int, int, int], device: int, values: tuple | list) -> None:
        self.launch(grid, device, [values[i] for i in self.order])

    def launch(self, grid: tuple[int, int, int], device: int, params: list) -> None:
        """Launch with the kernel's parameters in order."""
        self.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device), self.function, self.metadata,
                 None, None, None, *params)


def _hook_set(hook: Any) -> bool:
    """A hook is set: a plain callable, or a ``triton.knobs.HookChain`` holding calls."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooked() -> bool:
    rt = triton.knobs.runtime
    return _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return (grid + (1, 1))[:3] if len(grid) < 3 else grid


def _compile(kernel: Any, grid: tuple[int, ...], args: tuple, kwargs: dict) -> _Compiled | None:
    """Launch through Triton (compiling if needed); the compiled kernel for direct calls, or None
    when a parameter was left to its default."""
    ran = kernel[grid](*args, **kwargs)
    names = kernel.arg_names
    position = {name: len(args) + i for i, name in enumerate(kwargs)}  # launch options too (num_warps)
    position.update({name: i for i, name in enumerate(names[: len(args)])})
    if ran is None or any(name not in position for name in names):
        return None
    return _Compiled(ran, tuple(position[name] for name in names))


_tables: dict[int, dict[tuple, _Compiled | None]] = {}  # id(kernel) -> signature -> compiled
_plan_tables: list[dict] = []  # each @planned launcher's plans (tmoe.kernels.plan)
_local = threading.local()  # .cursor: the active LaunchSequence's (plan.py); .recorder: a recording CallReplay's (replay.py)


_generation = [0]  # bumped by clear_launch_caches: recorded launch sequences are recorded again


def clear_launch_caches() -> None:
    """Forget every signature seen: the next launches go through Triton again (tests)."""
    _tables.clear()
    for plans in _plan_tables:
        plans.clear()
    _generation[0] += 1


def direct_call_count() -> int:
    """How many signatures (launch and planned) have a compiled kernel for direct calls."""
    plans = [p for table in _plan_tables for p in table.values()]
    return (sum(c is not None for t in _tables.values() for c in t.values())
            + sum(len(p.compiled) for p in plans))


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` (``grid`` a tuple of up to three ints), with the direct
    call of the compiled kernel once this argument signature has been launched."""
    recorder = getattr(_local, "recorder", None)
    if recorder is None:
        _launch(kernel, grid, args, kwargs)
        return
    with recorder.launching(kernel, grid, {**dict(zip(kernel.arg_names, args)), **kwargs}) as entry:
        entry.compiled = _launch(kernel, grid, args, kwargs)


def _key_of(v: Any) -> Any:
    """What Triton specializes on in an argument: a tensor's dtype and 16-byte alignment, a
    descriptor's base dtype and alignment and its block (its sizes and strides are runtime
    values), any other value as it is."""
    if isinstance(v, _Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    if isinstance(v, TensorDescriptor):
        return (TensorDescriptor, v.base.dtype, v.base.data_ptr() % 16 == 0,
                *[tuple(x) if isinstance(x, list) else x for name, x in vars(v).items()
                  if name not in ("base", "shape", "strides")])
    return v


def _launch(kernel: Any, grid: tuple[int, ...], args: tuple, kwargs: dict) -> _Compiled | None:
    """Launch; the compiled kernel when it was called directly, None when through Triton."""
    if not DIRECT_CALLS or _hooked():
        kernel[grid](*args, **kwargs)
        return None
    values = args + tuple(kwargs.values())
    device = torch._C._cuda_getDevice()
    table = _tables.setdefault(id(kernel), {})
    key = (device, tuple(kwargs), tuple(_key_of(v) for v in values))
    compiled = table.get(key)
    if compiled is None:
        if len(table) >= MAX_SIGNATURES:
            table.clear()
        table[key] = _compile(kernel, grid, args, kwargs)
        return None
    compiled(_grid3(grid), device, values)
    return compiled
