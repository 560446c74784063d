"""Named per-dtype tolerances and one comparison helper that reports the worst element."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tmoe.runtime.replay import not_recorded


@dataclass(frozen=True)
class Tolerance:
    """``rel``: bound on ||out - ref|| / ||ref||; ``atol``/``rtol``: elementwise bound
    |out - ref| <= atol + rtol * |ref| (the reference's scale)."""

    rel: float
    atol: float
    rtol: float


# Named tolerances. float32: the kernels accumulate in fp32 (ieee dots); bf16/fp16:
# operands and the intermediate are rounded to the storage dtype; fp8: e4m3 has a 3-bit
# mantissa, relative step 2**-4 on both activations and weights.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rel=1e-5, atol=1e-5, rtol=1e-4),
    "float16": Tolerance(rel=2e-3, atol=2e-3, rtol=2e-2),
    "bfloat16": Tolerance(rel=1e-2, atol=1e-2, rtol=5e-2),
    "fp8": Tolerance(rel=6e-2, atol=5e-2, rtol=0.25),
}


def tolerance_for(dtype: torch.dtype | str) -> Tolerance:
    key = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if key.startswith("float8"):
        key = "fp8"
    return TOLERANCES[key]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    num = (out - ref).norm().item()
    return num / denom if denom > 0 else num


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance | torch.dtype | str, name: str = "out") -> None:
    """Assert ``out`` matches ``ref``: same shape, no NaN where ref is finite, the relative-norm
    bound, and the elementwise bound scaled by max|ref|. The message names the worst element."""
    tol = tol if isinstance(tol, Tolerance) else tolerance_for(tol)
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.numel() == 0:
        return
    finite = torch.isfinite(ref)
    bad_nan = finite & ~torch.isfinite(out)
    if bad_nan.any():
        idx = tuple(int(i) for i in bad_nan.nonzero()[0])
        raise AssertionError(f"{name}: {int(bad_nan.sum())} non-finite elements where the reference is finite, first at {idx}")
    same_special = (~finite) & ((out == ref) | (out.isnan() & ref.isnan()))
    if not bool((finite | same_special).all()):
        raise AssertionError(f"{name}: non-finite reference elements not reproduced")
    o, r = out[finite], ref[finite]
    scale = r.abs().max().item() if r.numel() else 0.0
    err = (o - r).abs()
    bound = tol.atol * max(scale, 1e-30) + tol.rtol * r.abs()
    rel = rel_error(o, r)
    worst = int(torch.argmax(err - bound)) if err.numel() else 0
    if rel > tol.rel or bool((err > bound).any()):
        pos = tuple(int(i) for i in torch.nonzero(finite)[worst])
        raise AssertionError(
            f"{name}: rel error {rel:.3e} (limit {tol.rel:.1e}); worst element {pos}: "
            f"got {o[worst].item():.6g}, want {r[worst].item():.6g} (|diff| {err[worst].item():.3e}, "
            f"bound {bound[worst].item():.3e})"
        )


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floats) or a large sentinel (ints) so unwritten elements fail a check.
    It stands in for an allocation, so a layer call recording its launches does not count the fill."""
    with not_recorded():
        if t.dtype.is_floating_point:
            return t.fill_(float("nan"))
        return t.fill_(torch.iinfo(t.dtype).max if t.dtype != torch.bool else True)
