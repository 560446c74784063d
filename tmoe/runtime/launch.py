"""Kernel launches with less host time: the direct call of a compiled kernel, and the launch caches.

``launch(kernel, grid, *args, **kwargs)`` is ``kernel[grid](*args, **kwargs)``, but after the first
launch of an argument signature it calls the compiled kernel directly, skipping Triton's per-call
binding, specialization and cache-key string (a 61-argument GEMM: tens of µs through
``kernel[grid]``, a fifth of it for the direct call; docs/runtime.md). The signature is what Triton
specializes on, taken exactly: each tensor's dtype and whether its address is 16-byte aligned,
every other argument's value (ints, floats, constexprs, launch options), the argument names and
the current device. Equal signatures compile to the same kernel, so the direct call runs exactly
what ``kernel[grid]`` would.

The signature tables, the direct-call switch and the recording hooks live in
``tmoe.runtime.state``.

Triton's own path is kept under the interpreter, without a CUDA device, with a launch hook
installed (profilers), and for tensor-descriptor arguments (the caller launches those itself)."""
from __future__ import annotations

from typing import Any

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from tmoe.runtime import state

try:  # the Gluon engine's host descriptors (a class of their own), where this Triton has them
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    DESCRIPTORS: tuple[type, ...] = (TensorDescriptor, GluonTensorDescriptor)
except ImportError:
    DESCRIPTORS = (TensorDescriptor, )

_Tensor = torch.Tensor


class Compiled:
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


def hooked() -> bool:
    rt = triton.knobs.runtime
    return _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)


def grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return (grid + (1, 1))[:3] if len(grid) < 3 else grid


def compile_launch(kernel: Any, grid: tuple[int, ...], args: tuple, kwargs: dict) -> Compiled | None:
    """Launch through Triton (compiling if needed); the compiled kernel for direct calls, or None
    when a parameter was left to its default."""
    ran = kernel[grid](*args, **kwargs)
    names = kernel.arg_names
    position = {name: len(args) + i for i, name in enumerate(kwargs)}  # launch options too (num_warps)
    position.update({name: i for i, name in enumerate(names[: len(args)])})
    if ran is None or any(name not in position for name in names):
        return None
    return Compiled(ran, tuple(position[name] for name in names))


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` (``grid`` a tuple of up to three ints), with the direct
    call of the compiled kernel once this argument signature has been launched."""
    recorder = state.recorder()
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
    if isinstance(v, DESCRIPTORS):
        return (type(v), v.base.dtype, v.base.data_ptr() % 16 == 0,
                *[tuple(x) if isinstance(x, list) else x for name, x in vars(v).items()
                  if name not in ("base", "shape", "strides")])
    return v


def _launch(kernel: Any, grid: tuple[int, ...], args: tuple, kwargs: dict) -> Compiled | None:
    """Launch; the compiled kernel when it was called directly, None when through Triton."""
    if not state.DIRECT_CALLS or hooked():
        kernel[grid](*args, **kwargs)
        return None
    values = args + tuple(kwargs.values())
    device = torch._C._cuda_getDevice()
    table = state.kernel_tables.setdefault(id(kernel), {})
    key = (device, tuple(kwargs), tuple(_key_of(v) for v in values))
    compiled = table.get(key)
    if compiled is None:
        if len(table) >= state.MAX_SIGNATURES:
            table.clear()
        table[key] = compile_launch(kernel, grid, args, kwargs)
        return None
    compiled(grid3(grid), device, values)
    return compiled
