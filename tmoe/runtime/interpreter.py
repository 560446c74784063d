"""Workarounds for faults of Triton's CPU interpreter (``TRITON_INTERPRET=1``), applied only while
a tmoe launcher runs.

Each one makes the interpreter compute what a GPU computes; kernel code is never changed for
them. All are present in Triton 3.6.0 through 3.9.0 (``tests/runtime/test_interpreter.py`` checks that
the unpatched interpreter still shows each fault, so a fixed one is noticed and dropped):

* fp32 -> bf16 casts truncate instead of rounding to nearest even, fp32 -> fp8 casts drop the
  mantissa carry (124.3 becomes 64, not 128) and fp8 NaN decodes as a number: the bit-twiddling
  ``_convert_float`` is routed through torch's casts, which round like the GPU's ``cvt.rn``
  (fp8 results saturate, as ``cvt.rn.satfinite``).
* ``tl.dot`` multiplies the raw uint16 bits of bfloat16 operands, and decodes fp8 operands with
  the faulty conversion (NaN lost): bf16 and fp8 operands are upcast to float32 first.
* ``tl.dot`` of float32 operands is numpy's BLAS sgemm, which sums a row's K products in an order
  that depends on the row's position in the tile and on the tile's M extent, and ``acc + dot``
  rounds once per K tile, so a token's result depended on its batch and on block_k. A GPU chains its
  FMAs or MMAs into the accumulator in ascending k: the dot sums each element's products one at a
  time from the accumulator in ascending k (``fixed_order_dot``), so a row depends on nothing else
  in the tile and a K loop gives the same bits whatever its block_k (batch invariance,
  ``docs/numerics.md``).
* A comparison's result keeps its operands' type, so a scalar mask such as ``tl.load(p) >= 0``
  broadcast against a block becomes an integer (or float) array: 3.9 rejects it as a load or
  store mask ("mask has unsupported dtype"), ``&`` with a float one fails on both. Comparisons
  return int1 (bool) results, as on a GPU.
* numpy prints RuntimeWarnings for IEEE special values a GPU handles silently (``exp(-inf)``,
  ``inf - inf``): silenced with ``np.errstate``.
* ``@triton.jit`` decides at definition whether a function is interpreted (``TRITON_INTERPRET``
  then): when Triton was imported before tmoe without it, ``triton.language``'s own jit helpers
  (``tl.sum``, ``tl.cdiv``, ...) are compiled-only and raise when an interpreted kernel calls them.
  A jit function called inside a tmoe launch runs interpreted. tmoe's own kernels are defined
  interpreted on a machine without a GPU (``interpreted_definitions``) whatever the environment
  says, without setting ``TRITON_INTERPRET`` for anybody else.
* Speed, not numerics: at every call of a jit helper the interpreter patches ``triton.language``
  again (``inspect.getmembers`` of three modules), about a fifth of an interpreted layer call; a
  helper whose modules the launch has already patched skips it. ``tl.xor_sum`` (inside
  ``tl.sort``) is reduced by numpy instead of one element at a time in Python, and the numpy
  dtype of a Triton type is remembered instead of rebuilt at every call. The interpreter checks
  every int32 add, sub and mul for overflow (``sanitize_overflow``, about a fifth of an
  interpreted layer call); a GPU build checks only with ``debug=True``: tmoe's launches run
  without the check, as on a GPU.
* The interpreter is not thread-safe (it patches ``triton.language`` for each launch): tmoe's
  interpreted launches take one process-wide lock, so threaded callers get right answers.

``interpreter_fixes`` swaps the patched functions in for the duration of a launch and puts the
originals back, so other Triton code in the process sees the interpreter unchanged; on a GPU
(no interpreter) ``with_interpreter_fixes`` returns the launcher untouched. The 3.6 interpreter's
scalar indexing fails on numpy >= 2.4 (3.7 to 3.9 do not): the ``test`` extra pins ``numpy<2.4``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import threading
from typing import Callable, Iterator, TypeVar

import torch
import triton

# Triton has no CPU backend: without a GPU tmoe's kernels run under the interpreter. An explicit
# TRITON_INTERPRET decides either way (1 interprets them on a GPU machine too; 0 compiles them without
# one, as tmoe.testing.sm90's compile-only runs need)
_EXPLICIT = os.environ.get("TRITON_INTERPRET")
INTERPRETED = (_EXPLICIT.strip().lower() in ("1", "true", "on", "yes") if _EXPLICIT is not None
               else not torch.cuda.is_available())

F = TypeVar("F", bound=Callable)

_lock = threading.Lock()
_launch_lock = threading.RLock()  # one interpreted tmoe launch (or layer call) at a time, process-wide
_active = threading.local()  # .on: this thread is inside interpreter_fixes (nested entries are free)
_depth = 0
_installed = False
_saved: list[tuple[object, str, object]] = []
_patches: list[tuple[object, str, object]] = []  # (owner, attribute, replacement)

_CMP_OPS = [f"create_icmp{op}" for op in ("SLE", "SLT", "SGE", "SGT", "ULE", "ULT", "UGE", "UGT", "EQ", "NE")] + [
    f"create_fcmp{op}" for op in ("OLT", "OGT", "OLE", "OGE", "OEQ", "ONE", "ULT", "UGT", "ULE", "UGE", "UEQ", "UNE")
]


def _build_patches() -> list[tuple[object, str, object]]:
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as interp

    torch_dtypes = {
        tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
        tl.float64: torch.float64, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2,
    }
    int_views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    round_to_nearest = (None, interp._ir.ROUNDING_MODE.RTNE)
    original_convert = interp._convert_float
    interpreted: dict[object, object] = {}  # a compiled-only jit function -> its interpreted twin
    original_dot = interp.InterpreterBuilder.create_dot

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        """The interpreter's raw float bits (unsigned ints) of ``input_dtype`` as ``output_dtype``."""
        src, dst = torch_dtypes.get(input_dtype), torch_dtypes.get(output_dtype)
        if src is None or dst is None or rounding_mode not in round_to_nearest:
            return original_convert(data, input_dtype, output_dtype, rounding_mode)
        bits = np.ascontiguousarray(data).view(f"u{src.itemsize}")
        x = torch.from_numpy(bits.view(f"i{src.itemsize}") if src.itemsize > 1 else bits).view(src)
        if dst.itemsize == 1:  # cvt.rn.satfinite: out-of-range values (and inf) saturate, NaN stays
            big = torch.finfo(dst).max
            x = x.float().clamp(-big, big)
        out = x.to(dst).view(int_views[dst.itemsize]).numpy()
        return out.view(f"u{dst.itemsize}").reshape(np.shape(data))

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def upcast(h):
            if h.dtype.scalar in (tl.bfloat16, tl.float8e4nv, tl.float8e5):
                return interp.TensorHandle(convert_float(h.data, h.dtype.scalar, tl.float32, None).view(np.float32),
                                           tl.float32)
            return h

        a, b = upcast(a), upcast(b)
        if a.data.dtype != np.float32 or b.data.dtype != np.float32 or d.data.dtype != np.float32:
            return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        return interp.TensorHandle(fixed_order_dot(a.data, b.data, d.data), d.dtype.scalar)

    def fixed_order_dot(a, b, acc):
        """acc + a @ b, each output element summing its K products one at a time in ascending k from
        acc (float32 adds, as a GPU's FMA or MMA chain accumulates), so a row's result depends on
        neither the other rows, the tile's M extent, nor how the K loop splits K into tiles. Slices
        [:, k, :] of one array are added in order (numpy reduces a non-innermost axis sequentially);
        BLAS's sgemm instead sums a row in an order that depends on its position in the tile."""
        terms = np.empty((a.shape[0], a.shape[1] + 1, b.shape[1]), dtype=np.float32)  # [BM, 1 + BK, BN]
        terms[:, 0, :] = acc
        np.multiply(a[:, :, None], b[None, :, :], out=terms[:, 1:, :])
        return np.add.reduce(terms, axis=1)

    def boolean(compare):
        def create_cmp(self, lhs, rhs):
            out = compare(self, lhs, rhs)
            return interp.TensorHandle(out.data.astype(bool, copy=False), tl.int1)

        return create_cmp

    def call_jit_function(self, *args, **kwargs):
        """A compiled-only ``@triton.jit`` function called from an interpreted kernel, interpreted."""
        twin = interpreted.get(self.fn)
        if twin is None:
            twin = interpreted[self.fn] = interp.InterpretedFunction(self.fn)
        return twin(*args, **kwargs)

    original_patch_lang = interp._patch_lang

    langs_of: dict[object, list] = {}  # a jit function -> the triton.language modules its globals hold

    def patch_lang(fn):
        """``triton.language`` patched for ``fn``; a no-op when its modules already are (a helper
        called inside a launch whose kernel patched them: the interpreter re-patches at every call)."""
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
            return interp._LangPatchScope()
        return original_patch_lang(fn)

    original_reduce = interp.ReduceOps.apply_impl

    def reduce(self, input):
        """``tl.xor_sum`` (``tl.sort``'s compare-and-swap) with numpy's xor reduction; the interpreter
        runs a reduction whose combine function it does not know one element at a time in Python."""
        if self.combine_fn == tl.standard._xor_combine and len(input) == 1:
            data = np.bitwise_xor.reduce(input[0].handle.data, axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(data, input[0].dtype)
        return original_reduce(self, input)

    original_np_dtype = interp._get_np_dtype
    np_dtypes: dict[object, object] = {}

    def np_dtype(tt_dtype):
        """The interpreter's numpy dtype of a Triton type, its own answer remembered per scalar type
        (it builds an 18-entry table at every call)."""
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return original_np_dtype(scalar)
        found = np_dtypes.get(scalar)
        if found is None:
            found = np_dtypes[scalar] = original_np_dtype(scalar)
        return found

    # the overflow sanitizer checks every int32 add, sub and mul in numpy (a fifth of an interpreted
    # layer call); compiled kernels run without it unless built with debug=True
    options = dataclasses.replace(interp.interpreter_builder.options, sanitize_overflow=False)
    builder = interp.InterpreterBuilder
    return [(interp.interpreter_builder, "options", options), (interp, "_convert_float", convert_float), (builder, "create_dot", create_dot),
            (triton.runtime.jit.JITFunction, "__call__", call_jit_function), (interp, "_patch_lang", patch_lang),
            (interp.ReduceOps, "apply_impl", reduce), (interp, "_get_np_dtype", np_dtype)] + [
        (builder, name, boolean(getattr(builder, name))) for name in _CMP_OPS
    ]


def _swap_in() -> None:
    global _depth
    with _lock:
        if _depth == 0:
            if not _patches:
                _patches.extend(_build_patches())
            _saved[:] = [(owner, name, getattr(owner, name)) for owner, name, _ in _patches]
            for owner, name, replacement in _patches:
                setattr(owner, name, replacement)
        _depth += 1


def _swap_out() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0:
            for owner, name, original in _saved:
                setattr(owner, name, original)
            _saved.clear()


@contextlib.contextmanager
def interpreter_fixes() -> Iterator[None]:
    """Apply the workarounds above while the block runs (reentrant, thread-safe); no-op on a GPU."""
    if not INTERPRETED:
        yield
        return
    if getattr(_active, "on", False):
        yield
        return
    import numpy as np

    with _launch_lock:
        _swap_in()
        _active.on = True
        try:
            with np.errstate(all="ignore"):
                yield
        finally:
            _active.on = False
            _swap_out()


@contextlib.contextmanager
def interpreted_definitions() -> Iterator[None]:
    """``@triton.jit`` in the block defines interpreted functions when ``INTERPRETED`` (tmoe's
    kernel modules are imported in it); the knob and ``TRITON_INTERPRET`` are put back after."""
    if not INTERPRETED or triton.knobs.runtime.interpret:
        yield
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # the knob reads the environment when @triton.jit runs
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def install_interpreter_fixes() -> None:
    """Apply the interpreter workarounds (not the warning filter) for the rest of the process, to
    every Triton kernel, tmoe's or not (idempotent; no-op on a GPU). tmoe's launchers do not need it."""
    global _installed
    if INTERPRETED and not _installed:
        _swap_in()
        _installed = True


def with_interpreter_fixes(launcher: F) -> F:
    """Decorate a launcher so its kernels run with the workarounds; returns it unchanged on a GPU.
    Decorate a function that calls several launchers too: they then share one swap."""
    if not INTERPRETED:
        return launcher

    @functools.wraps(launcher)
    def wrapped(*args, **kwargs):
        if getattr(_active, "on", False):  # an enclosing call holds the fixes (a layer call's launches)
            return launcher(*args, **kwargs)
        with interpreter_fixes():
            return launcher(*args, **kwargs)

    return wrapped
