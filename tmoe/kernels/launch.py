"""Kernel launches with less host time.

``launch(kernel, grid, *args, **kwargs)`` is ``kernel[grid](*args, **kwargs)``, but after the first
launch of an argument signature it calls the compiled kernel directly, skipping Triton's per-call
binding, specialization and cache-key string (measured on the H200 host, Triton 3.6, a 61-argument
GEMM: 62 µs through ``kernel[grid]``, 12 µs for the direct call). The signature is what Triton
specializes on, taken exactly: each tensor's dtype and whether its address is 16-byte aligned,
every other argument's value (ints, floats, constexprs, launch options), the argument names and
the current device. Equal signatures compile to the same kernel, so the direct call runs exactly
what ``kernel[grid]`` would.

``@planned`` goes one step further for a launcher whose kernel reads its arguments' tensors
directly: the launcher's body (checks, tile fitting, strides, the kernel's keyword arguments)
runs once per static signature of the launcher's arguments, and later calls only swap the
tensors in. ``LaunchSequence`` records the planned launches of a composite call (a layer call)
so later calls with the same signature replay them without computing each launcher's key.

Triton's own path is kept under the interpreter, without a CUDA device, with a launch hook
installed (profilers), and for tensor-descriptor arguments (the caller launches those itself)."""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels.interpreter import INTERPRETED
from tmoe.kernels.pdl import pdl_requested

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
_plan_tables: list[dict] = []  # each @planned launcher's plans


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


@dataclass
class Launch:
    """What a ``@planned`` launcher's body asks for: ``kernel[grid](**kwargs)``, then return ``result``."""

    kernel: Any
    grid: tuple[int, ...]
    kwargs: dict[str, Any]
    result: Any


def _leaves(args: tuple, kwargs: dict) -> list:
    """The arguments, dataclass arguments that carry tensors (routing, scales) replaced by their
    type and fields (a GemmConfig is a plain hashable value)."""
    out = []
    for v in (*args, *kwargs.values()):
        if hasattr(v, "__dataclass_fields__") and not isinstance(v, GemmConfig):
            out.append(type(v))
            out.extend(v.__dict__.values())
        else:
            out.append(v)
    return out


def _static(v: Any) -> Any:
    if isinstance(v, _Tensor):
        return v.shape, v.stride(), v.dtype, v.device, v.data_ptr() % 16 == 0
    return v


class _Plan:
    """A Launch with its tensors replaced by slots: indices into the call's leaves."""

    __slots__ = ("kernel", "grid", "grid3", "names", "static", "slots", "result_slot", "compiled", "template",
                 "positions")

    def __init__(self, launch_: Launch, leaves: list) -> None:
        where = {id(v): i for i, v in enumerate(leaves) if isinstance(v, _Tensor)}
        tensors = {name: v for name, v in launch_.kwargs.items() if isinstance(v, _Tensor)}
        if any(id(v) not in where for v in tensors.values()) or id(launch_.result) not in where:
            raise LookupError("a launch tensor is not one of the launcher's arguments")
        self.kernel, self.grid, self.grid3 = launch_.kernel, launch_.grid, _grid3(launch_.grid)
        self.names = tuple(tensors)
        self.static = {name: v for name, v in launch_.kwargs.items() if name not in tensors}
        self.slots = tuple(where[id(v)] for v in tensors.values())
        self.result_slot = where[id(launch_.result)]
        self.compiled: dict[int, _Compiled] = {}  # device index -> compiled
        self.template: list = []  # the kernel's parameters in order, tensors as placeholders
        self.positions: tuple[int, ...] = ()  # where each slot's tensor goes in the template

    def __call__(self, leaves: list) -> Any:
        recorder = getattr(_local, "recorder", None)
        if recorder is None:
            self._launch(leaves)
        else:
            with recorder.launching(self.kernel, self.grid,
                                    {**self.static, **{n: leaves[i] for n, i in zip(self.names, self.slots)}}) as entry:
                entry.compiled = self._launch(leaves)
        return leaves[self.result_slot]

    def _launch(self, leaves: list) -> _Compiled | None:
        """Launch; the compiled kernel when it was called directly, None when through Triton."""
        if not DIRECT_CALLS or _hooked():
            self.kernel[self.grid](**self.static, **{n: leaves[i] for n, i in zip(self.names, self.slots)})
            return None
        device = torch._C._cuda_getDevice()
        compiled = self.compiled.get(device)
        if compiled is None:
            self._first_launch(device, [leaves[i] for i in self.slots])
            return None
        params = self.template.copy()
        for pos, i in zip(self.positions, self.slots):
            params[pos] = leaves[i]
        compiled.launch(self.grid3, device, params)
        return compiled

    def _first_launch(self, device: int, tensors: list) -> None:
        """Through Triton; keep the compiled kernel (unless it cannot be called directly)."""
        kwargs = {**dict(zip(self.names, tensors)), **self.static}
        compiled = _compile(self.kernel, self.grid, (), kwargs)
        if compiled is None:  # not directly callable: every launch goes through Triton
            return
        values = (*tensors, *self.static.values())
        self.positions = tuple(compiled.order.index(j) for j in range(len(tensors)))
        self.template = [values[i] for i in compiled.order]
        for pos in self.positions:  # hold no tensor of this call
            self.template[pos] = None
        self.compiled[device] = compiled


class LaunchSequence:
    """The planned launches of one call of a composite (a layer call), recorded in order so later
    calls with the same static signature replay them without recomputing each launcher's key.

    ``with seq.active():`` records on the first use and replays afterwards. Sound when every
    launcher's arguments are a function of the composite's signature: the caller keys the
    sequence by everything the launches depend on (shapes, strides, dtypes, devices, alignment,
    configuration state). A launch that cannot be replayed (a body that launched itself, or a
    different launcher at a step) makes the sequence fall back to the per-launcher keys for good."""

    __slots__ = ("steps", "recorded", "valid", "generation")

    def __init__(self) -> None:
        self.steps: list[tuple[Callable, _Plan]] = []
        self.recorded = False
        self.valid = True
        self.generation = _generation[0]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.generation != _generation[0]:  # the caches were cleared: record afresh
            self.steps, self.recorded, self.valid, self.generation = [], False, True, _generation[0]
        if not self.valid:
            yield
            return
        prior = getattr(_local, "cursor", None)
        cursor = _Cursor(self, "replay" if self.recorded else "record")
        _local.cursor = cursor
        try:
            yield
        finally:
            _local.cursor = prior
        if cursor.mode == "record":
            self.steps, self.recorded = cursor.steps, True
        elif cursor.mode == "replay" and cursor.index != len(self.steps):
            self.valid = False


class _Cursor:
    """One composite call's position in its LaunchSequence; ``mode`` "record", "replay" or "off"
    (a mismatch or an unplannable launch: the rest of the call takes the per-launcher keys)."""

    __slots__ = ("seq", "mode", "index", "steps")

    def __init__(self, seq: LaunchSequence, mode: str) -> None:
        self.seq, self.mode, self.index, self.steps = seq, mode, 0, []

    def next_plan(self, launcher: Callable) -> _Plan | None:
        steps, i = self.seq.steps, self.index
        self.index += 1
        if i < len(steps) and steps[i][0] is launcher:
            return steps[i][1]
        self.seq.valid, self.mode = False, "off"
        return None

    def record(self, launcher: Callable, plan: _Plan | None) -> None:
        if plan is None:
            self.seq.valid, self.mode = False, "off"
        else:
            self.steps.append((launcher, plan))


_local = threading.local()  # .cursor: the active LaunchSequence's cursor; .recorder: a recording CallReplay's (replay.py)


def planned(body: Callable[..., Launch | Any]) -> Callable[..., Any]:
    """Decorate a launcher body that checks its arguments and returns the ``Launch`` to run (or a
    plain result when there is nothing to launch). The Launch is kept per static signature of the
    arguments (each tensor's shape, strides, dtype, device and 16-byte alignment; dataclass
    arguments field by field; other values as they are) and the PDL switch, with its tensors as slots into the
    arguments; a later call of the signature skips the body and launches with its own tensors.
    A body whose launch reads a tensor it made itself (not an argument) runs every call."""
    plans: dict[tuple, _Plan | None] = {}
    _plan_tables.append(plans)

    @functools.wraps(body)
    def launcher(*args: Any, **kwargs: Any) -> Any:
        leaves = _leaves(args, kwargs)
        cursor = getattr(_local, "cursor", None)
        mode = cursor.mode if cursor is not None else "off"
        if mode == "replay":
            plan = cursor.next_plan(launcher)
            if plan is not None:
                return plan(leaves)
        key = (tuple(kwargs), pdl_requested(), *[_static(v) for v in leaves])  # bodies read the PDL switch
        plan = plans.get(key)
        if plan is None:
            launch_ = body(*args, **kwargs)
            if isinstance(launch_, Launch):
                try:
                    plan = _Plan(launch_, leaves)
                except LookupError:
                    launch(launch_.kernel, launch_.grid, **launch_.kwargs)
                    launch_ = launch_.result
            if plan is None:
                if mode == "record":
                    cursor.record(launcher, None)
                return launch_
            if len(plans) >= MAX_SIGNATURES:
                plans.clear()
            plans[key] = plan
        if mode == "record":
            cursor.record(launcher, plan)
        return plan(leaves)

    return launcher
