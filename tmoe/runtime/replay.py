"""Whole-call replay: a composite call (a layer call) whose launches are a function of its static
signature records them once and later calls only launch them again with their own tensors.

``CallReplay.run(inputs, body)``: the first call of a signature runs ``body`` plainly; the second
runs it while recording every launch (``tmoe.runtime.launch`` and ``tmoe.runtime.plan`` report
each one) and every torch operation (a ``TorchDispatchMode``); from the third on, when the
recording is sound, the launches are replayed without running ``body``. A recording is sound
when the call's device work was Triton launches only (torch operations other than allocations and
views refuse it: a copy or a fill would be skipped by a replay), and every tensor a launch read is
one of three kinds, told apart by its storage:

- a view into one of the call's ``inputs`` (the layer arguments and the output): replayed at the
  same byte offset from that input's address;
- memory the call allocated (workspaces, routing buffers; the dispatch mode sees each
  allocation): replayed in one fresh allocation per call, at the same offsets (each storage
  256-byte aligned);
- memory from before the call that is no input (a cached constant): replayed as it is.

A replay launches the compiled kernels directly with integer addresses on a GPU, and through
Triton (tensors rebuilt as views) under the interpreter. Calls run plainly while a launch hook is
installed (profilers then see Triton's launches) and while a CUDA graph is captured; recordings
are dropped by ``clear_launch_caches``."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from triton.tools.tensor_descriptor import TensorDescriptor

from tmoe.runtime import state
from tmoe.runtime.launch import DESCRIPTORS, grid3, hooked

RECORD_ATTEMPTS = 3  # recordings tried per signature before it keeps the plain path
_ALIGN = 256
_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                torch.ops.aten.new_empty_strided.default}
_IN, _WS, _CONST, _DESC, _SAME = range(5)  # _SAME: an input itself (same dtype, shape, strides)


class _DeviceWorkCheck(TorchDispatchMode):
    """Notes the storages a recorded call allocates, and any torch operation that is neither an
    allocation nor a view."""

    def __init__(self) -> None:
        super().__init__()
        self.other: list[str] = []
        self.allocated: set[int] = set()  # storage addresses

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocated.add(out.untyped_storage().data_ptr())
        elif not func.is_view:
            self.other.append(str(func))
        return out


@dataclasses.dataclass
class _Launched:
    kernel: Any
    grid: tuple[int, ...]
    kwargs: dict[str, Any]
    compiled: Any = None  # the _Compiled a direct call used; None: Triton's path


class _Recorder:
    """The launches of one recorded call, in order (``launch`` and planned launchers call ``launching``)."""

    def __init__(self) -> None:
        self.launches: list[_Launched] = []
        self.check = _DeviceWorkCheck()

    @contextlib.contextmanager
    def launching(self, kernel: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> Iterator[_Launched]:
        entry = _Launched(kernel, grid, kwargs)
        with _disable_current_modes():  # the kernel's own host work (the interpreter's) is not the call's
            yield entry
        self.launches.append(entry)


@contextlib.contextmanager
def not_recorded() -> Iterator[None]:
    """Torch operations in the block are not part of a recorded call (``tmoe.testing.poison``,
    which stands in for an allocation)."""
    if state.recorder() is None:
        yield
        return
    with _disable_current_modes():
        yield


class _Step:
    """One launch of a replay: its parameters in the kernel's order with the tensors left out,
    and where each tensor comes from."""

    __slots__ = ("kernel", "grid", "grid3", "compiled", "names", "template", "sources")

    def __init__(self, launched: _Launched, sources: dict[str, tuple]) -> None:
        self.kernel, self.grid, self.grid3 = launched.kernel, launched.grid, grid3(launched.grid)
        self.compiled = launched.compiled
        self.names = tuple(launched.kernel.arg_names) if self.compiled is not None else tuple(launched.kwargs)
        self.template = [None if n in sources else launched.kwargs[n] for n in self.names]
        self.sources = tuple((self.names.index(n), src) for n, src in sources.items())


def _capturing() -> bool:
    """A CUDA graph is being captured: the call runs plainly (its host time is paid once) and
    nothing recorded holds memory of the graph's pool."""
    return state.DIRECT_CALLS and torch.cuda.is_current_stream_capturing()


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last (at least one element's worth)."""
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) + 1) * t.element_size()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())


def _owner(spans: list[tuple[int, int, int]], address: int) -> int | None:
    """The input whose bytes hold ``address``: one input, or the output and hidden_states when
    they are one tensor (an in-place call, part of the signature); None when no input or several."""
    owners = [i for start, end, i in spans if start <= address < end]
    if len(owners) == 1 or (len(owners) == 2 and owners[0] == 0 and owners[1] == 1
                            and spans[0][:2] == spans[1][:2]):
        return owners[0]
    return None


def _with_base(desc: TensorDescriptor, base: torch.Tensor | None) -> TensorDescriptor:
    """``desc`` on another base of the same dtype, alignment and layout (checked when recorded)."""
    out = copy.copy(desc)
    out.base = base
    return out


class CallReplay:
    """The recorded launches of one call signature (``run``); holds no tensor of a call."""

    __slots__ = ("calls", "attempts", "steps", "arena_bytes", "device", "keep", "generation")

    def __init__(self) -> None:
        self.calls, self.attempts, self.steps = 0, 0, None
        self.arena_bytes, self.device, self.keep, self.generation = 0, None, [], state.generation()

    def run(self, inputs: tuple, body: Callable[[], Any]) -> Any:
        """``body()`` (which launches the call's kernels and returns ``inputs[0]``), or its replay.
        ``inputs``: the call's tensors (None allowed), the output first."""
        if self.generation != state.generation():
            self.calls, self.attempts, self.steps, self.keep = 0, 0, None, []
            self.generation = state.generation()
        if hooked() or _capturing():
            return body()
        if self.steps is not None and self._on_device():
            self._replay(inputs)
            return inputs[0]
        self.calls += 1
        if self.calls < 2 or self.attempts >= RECORD_ATTEMPTS or state.recorder() is not None:
            return body()
        self.attempts += 1
        recorder = _Recorder()
        state.set_recorder(recorder)
        try:
            with recorder.check:
                result = body()
        finally:
            state.set_recorder(None)
        if not recorder.check.other:
            self._build(inputs, recorder.launches, recorder.check.allocated)
        return result

    def _on_device(self) -> bool:
        return self.device is None or self.device == torch._C._cuda_getDevice()

    def _build(self, inputs: tuple, launches: list[_Launched], allocated: set[int]) -> None:
        """Turn a recording into steps, or leave ``steps`` None when it cannot be replayed."""
        direct = state.DIRECT_CALLS
        if not launches or any((e.compiled is None) == direct for e in launches):
            return
        spans = [(t.data_ptr(), t.data_ptr() + _extent(t), i) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
        input_storages = {_storage_ptr(inputs[i]) for _, _, i in spans}
        held: dict[int, torch.UntypedStorage] = {}  # address -> the largest storage seen there, for storages no input owns
        raw: list[tuple[_Launched, dict[str, tuple]]] = []
        for entry in launches:
            sources = {}
            for name, v in entry.kwargs.items():
                if isinstance(v, DESCRIPTORS):
                    i = _owner(spans, v.base.data_ptr())
                    if i is None or v.base.data_ptr() != inputs[i].data_ptr() or v.base.dtype != inputs[i].dtype:
                        return
                    sources[name] = (_DESC, i, _with_base(v, None))
                elif isinstance(v, torch.Tensor):
                    meta = (v.dtype, tuple(v.shape), v.stride())
                    sp = _storage_ptr(v)
                    i = _owner(spans, v.data_ptr())
                    if i is not None and _same_view(v, inputs[i]):
                        sources[name] = (_SAME, i)
                    elif i is not None:
                        sources[name] = (_IN, i, v.data_ptr() - inputs[i].data_ptr(), *meta)
                    elif sp in input_storages:  # beside an input, in its storage: not a function of the inputs
                        return
                    else:
                        if sp not in held or v.untyped_storage().nbytes() > held[sp].nbytes():
                            held[sp] = v.untyped_storage()
                        sources[name] = (_WS, sp, v.data_ptr() - sp, *meta)
            entry.kwargs = {n: None if n in sources else v for n, v in entry.kwargs.items()}
            raw.append((entry, sources))
        offsets, keep, total = {}, [], 0
        for sp, storage in held.items():
            if sp in allocated:  # the call's own memory (a workspace): a fresh slot of the arena per replay
                offsets[sp] = (_WS, total)
                total += -(-storage.nbytes() // _ALIGN) * _ALIGN
            else:  # memory from before the call (a cached constant): kept and read as it is
                offsets[sp] = (_CONST, len(keep))
                keep.append(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
        steps = []
        for entry, sources in raw:
            for name, src in sources.items():
                if src[0] == _WS:
                    kind, where = offsets[src[1]]
                    sources[name] = (kind, where, src[2], *src[3:])
            steps.append(_Step(entry, sources))
        self.steps, self.arena_bytes, self.keep = steps, total, keep
        self.device = torch._C._cuda_getDevice() if direct else None

    def _replay(self, inputs: tuple) -> None:
        first = next(t for t in inputs if isinstance(t, torch.Tensor))
        arena = torch.empty(self.arena_bytes, dtype=torch.uint8, device=first.device)
        if state.DIRECT_CALLS:
            self._launch_direct(inputs, arena)
        else:
            self._launch_triton(inputs, arena)

    def _launch_direct(self, inputs: tuple, arena: torch.Tensor) -> None:
        base = arena.data_ptr()
        device = self.device
        for step in self.steps:
            params = step.template.copy()
            for pos, src in step.sources:
                kind = src[0]
                if kind == _SAME:
                    params[pos] = inputs[src[1]].data_ptr()
                elif kind == _IN:
                    params[pos] = inputs[src[1]].data_ptr() + src[2]
                elif kind == _WS:
                    params[pos] = base + src[1] + src[2]
                elif kind == _CONST:
                    params[pos] = self.keep[src[1]].data_ptr() + src[2]  # a uint8 view of the kept storage
                else:
                    params[pos] = _with_base(src[2], inputs[src[1]])
            step.compiled.launch(step.grid3, device, params)

    def _launch_triton(self, inputs: tuple, arena: torch.Tensor) -> None:
        typed: dict[torch.dtype, torch.Tensor] = {}  # the arena viewed in each dtype a launch reads
        for step in self.steps:
            values = step.template.copy()
            for pos, src in step.sources:
                kind = src[0]
                if kind == _SAME:
                    values[pos] = inputs[src[1]]
                    continue
                if kind == _DESC:
                    values[pos] = _with_base(src[2], inputs[src[1]])
                    continue
                dtype, shape, stride = src[3:]
                if kind == _IN:
                    t = inputs[src[1]]
                    if t.dtype != dtype:
                        t = t.view(dtype)  # reinterpreted (same element size, as when recorded)
                    values[pos] = t.as_strided(shape, stride, t.storage_offset() + src[2] // dtype.itemsize)
                    continue
                if kind == _WS:
                    base, offset = typed.get(dtype), src[1] + src[2]
                    if base is None:
                        base = typed[dtype] = arena.view(dtype)
                else:
                    base, offset = self.keep[src[1]].view(dtype), src[2]
                values[pos] = base.as_strided(shape, stride, offset // dtype.itemsize)
            step.kernel[step.grid](**dict(zip(step.names, values)))
