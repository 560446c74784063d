"""Workarounds for numerics faults of the Triton 3.6 CPU interpreter (``TRITON_INTERPRET=1``).

These patch the interpreter only; kernel code is never changed. A GPU rounds
correctly, so each patch makes the interpreter compute what the GPU computes:

* fp32 -> bf16 casts truncate instead of rounding to nearest even, and
  fp32 -> fp8 casts drop the mantissa carry (124.3 becomes 64, not 128): the
  interpreter's bit-twiddling ``_convert_float`` is routed through torch's casts,
  which round to nearest even like the GPU's ``cvt.rn``.
* ``tl.dot`` on bfloat16 operands multiplies the raw uint16 bit patterns
  (garbage): bf16 and fp8 operands are upcast to float32 before the matmul.

The numpy >= 2.4 scalar-indexing fault is handled by pinning ``numpy<2.4``
in the ``test`` extra.
"""
from __future__ import annotations

import numpy as np
import torch

_PATCHED = False


def _torch_dtype(tl_dtype) -> torch.dtype | None:
    import triton.language as tl

    return {
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float64: torch.float64,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
    }.get(tl_dtype)


def _np_to_torch(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the interpreter's raw bits (stored as unsigned ints) as ``dtype``."""
    return torch.from_numpy(np.ascontiguousarray(data).view(f"i{dtype.itemsize}")).view(dtype)


def _torch_to_np(t: torch.Tensor) -> np.ndarray:
    n = t.dtype.itemsize
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[n]).numpy().view(f"u{n}")


def patch_interpreter() -> None:
    """Apply the workarounds above to ``triton.runtime.interpreter`` (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    from triton.runtime import interpreter as interp

    original_convert = interp._convert_float

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        src, dst = _torch_dtype(input_dtype), _torch_dtype(output_dtype)
        if src is None or dst is None:
            return original_convert(data, input_dtype, output_dtype, rounding_mode)
        shape = np.shape(data)
        out = _np_to_torch(np.asarray(data).reshape(-1), src).to(dst)
        return _torch_to_np(out).reshape(shape)

    original_dot = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        import triton.language as tl

        def upcast(h):
            if h.dtype.scalar in (tl.bfloat16, tl.float8e4nv, tl.float8e5):
                f32 = convert_float(h.data, h.dtype.scalar, tl.float32, None).view(np.float32)
                return interp.TensorHandle(f32, tl.float32)
            return h

        return original_dot(self, upcast(a), upcast(b), d, input_precision, max_num_imprecise_acc)

    interp._convert_float = convert_float
    interp.InterpreterBuilder.create_dot = create_dot
    _PATCHED = True
