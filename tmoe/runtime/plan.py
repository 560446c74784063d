"""Planned launchers: a launcher's body runs once per static signature of its arguments.

``@planned`` is for a launcher whose kernel reads its arguments' tensors directly: the launcher's
body (checks, tile fitting, strides, the kernel's keyword arguments) returns a ``Launch`` and runs
once per static signature of the launcher's arguments; later calls only swap the tensors in and
launch through the direct call of ``tmoe.runtime.launch``. ``LaunchSequence`` records the planned
launches of a composite call (a layer call) so later calls with the same signature replay them
without computing each launcher's key. The plan tables live in ``tmoe.runtime.state``, so
``clear_launch_caches`` drops them with the kernels' signatures."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from tmoe.runtime import state
from tmoe.runtime.launch import Compiled, compile_launch, grid3, hooked, launch
from tmoe.runtime.pdl import pdl_requested

_Tensor = torch.Tensor


@dataclass
class Launch:
    """What a ``@planned`` launcher's body asks for: ``kernel[grid](**kwargs)``, then return ``result``."""

    kernel: Any
    grid: tuple[int, ...]
    kwargs: dict[str, Any]
    result: Any


def _leaves(args: tuple, kwargs: dict) -> list:
    """The arguments, dataclass arguments that carry tensors (routing, scales) replaced by their
    type and fields (a value marked ``PLAN_AS_VALUE``, such as a tile config, is a plain hashable value)."""
    out = []
    for v in (*args, *kwargs.values()):
        if hasattr(v, "__dataclass_fields__") and not getattr(v, "PLAN_AS_VALUE", False):
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
        self.kernel, self.grid, self.grid3 = launch_.kernel, launch_.grid, grid3(launch_.grid)
        self.names = tuple(tensors)
        self.static = {name: v for name, v in launch_.kwargs.items() if name not in tensors}
        self.slots = tuple(where[id(v)] for v in tensors.values())
        self.result_slot = where[id(launch_.result)]
        self.compiled: dict[int, Compiled] = {}  # device index -> compiled
        self.template: list = []  # the kernel's parameters in order, tensors as placeholders
        self.positions: tuple[int, ...] = ()  # where each slot's tensor goes in the template

    def __call__(self, leaves: list) -> Any:
        recorder = state.recorder()
        if recorder is None:
            self._launch(leaves)
        else:
            with recorder.launching(self.kernel, self.grid,
                                    {**self.static, **{n: leaves[i] for n, i in zip(self.names, self.slots)}}) as entry:
                entry.compiled = self._launch(leaves)
        return leaves[self.result_slot]

    def _launch(self, leaves: list) -> Compiled | None:
        """Launch; the compiled kernel when it was called directly, None when through Triton."""
        if not state.DIRECT_CALLS or hooked():
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
        compiled = compile_launch(self.kernel, self.grid, (), kwargs)
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
        self.generation = state.generation()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.generation != state.generation():  # the caches were cleared: record afresh
            self.steps, self.recorded, self.valid, self.generation = [], False, True, state.generation()
        if not self.valid:
            yield
            return
        prior = state.cursor()
        cursor = _Cursor(self, "replay" if self.recorded else "record")
        state.set_cursor(cursor)
        try:
            yield
        finally:
            state.set_cursor(prior)
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


def planned(body: Callable[..., Launch | Any]) -> Callable[..., Any]:
    """Decorate a launcher body that checks its arguments and returns the ``Launch`` to run (or a
    plain result when there is nothing to launch). The Launch is kept per static signature of the
    arguments (each tensor's shape, strides, dtype, device and 16-byte alignment; dataclass
    arguments field by field; other values as they are) and the PDL switch, with its tensors as slots into the
    arguments; a later call of the signature skips the body and launches with its own tensors.
    A body whose launch reads a tensor it made itself (not an argument) runs every call."""
    plans: dict[tuple, _Plan | None] = {}
    state.register_plans(plans)

    @functools.wraps(body)
    def launcher(*args: Any, **kwargs: Any) -> Any:
        leaves = _leaves(args, kwargs)
        cursor = state.cursor()
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
            if len(plans) >= state.MAX_SIGNATURES:
                plans.clear()
            plans[key] = plan
        if mode == "record":
            cursor.record(launcher, plan)
        return plan(leaves)

    return launcher
