"""FP8 (e4m3fn) activation quantization: per token group, per token, static per tensor.

q = clamp(x / scale, -448, 448) cast to float8_e4m3fn, rounding to nearest even. The division is
IEEE (``tl.div_rn``; a plain ``/`` is approximate on NVIDIA GPUs), so codes match
``(x.float() / scale).to(torch.float8_e4m3fn)`` bit for bit. Dynamic scales are
``max(absmax, eps) / 448``; the absmax ignores NaN (a NaN element quantizes to NaN, its
neighbours normally) and an inf makes its group's scale inf. Rows are the flattened leading
dims of x; row offsets are int64.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tmoe.kernels.checks import FLOAT_DTYPES, FP8_DTYPES, check_last_dim_contiguous, check_shape, check_tensor
from tmoe.kernels._details.common import abs_no_nan, fp8_scale, to_fp8
from tmoe.kernels.sizes import cdiv, next_power_of_2
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch
from tmoe.runtime.pdl import pdl_args, pdl_launch_dependents, pdl_wait

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# eps >= MIN_EPS keeps every dynamic scale a positive normal float32 (exact ue8m0 rounding, no 0/0).
MIN_EPS = FP8_MAX * torch.finfo(torch.float32).tiny
TILE = 1024  # elements a group-quant program holds at once (H200: 2 warps, about 2.8 TB/s)
PER_TOKEN_BLOCK_K = 16384  # a row up to this long is read once, held in registers (at most 32 values a thread)


@triton.jit(do_not_specialize=['stride_sg'])
def _per_token_group_quant_fp8_kernel(
    x_ptr,  # [rows, K] float, unit stride along K
    q_ptr,  # [rows, K] float8_e4m3fn, unit stride along K
    s_ptr,  # [rows, G] float32, strides (stride_sm, stride_sg): row- or column-major
    num_rows_ptr,  # [1] int32: rows to quantize (LIMIT_ROWS)
    num_groups, group_size, eps,
    stride_xm, stride_qm, stride_sm, stride_sg,
    FP8_MAX: tl.constexpr, USE_UE8M0: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    LIMIT_ROWS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    if LIMIT_ROWS:
        if pid_m >= tl.load(num_rows_ptr):
            return
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BG]
    offs_s = tl.arange(0, BLOCK_S)  # [BS]
    mask_g = offs_g < num_groups
    mask = mask_g[:, None] & (offs_s < group_size)[None, :]  # [BG, BS]
    offs_k = offs_g[:, None] * group_size + offs_s[None, :]  # [BG, BS]
    x = tl.load(x_ptr + pid_m * stride_xm + offs_k, mask=mask, other=0.0).to(tl.float32)
    pdl_launch_dependents(USE_PDL)
    scale = fp8_scale(tl.max(abs_no_nan(x), axis=1), eps, FP8_MAX, USE_UE8M0)  # [BG]
    q = to_fp8(x, tl.broadcast_to(scale[:, None], (BLOCK_G, BLOCK_S)), FP8_MAX)
    tl.store(q_ptr + pid_m * stride_qm + offs_k, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + pid_m * stride_sm + offs_g.to(tl.int64) * stride_sg, scale, mask=mask_g)


@triton.jit
def _per_token_quant_fp8_kernel(
    x_ptr,  # [rows, K] float, unit stride along K
    q_ptr,  # [rows, K] float8_e4m3fn, unit stride along K
    s_ptr,  # [rows] float32
    num_rows_ptr,  # [1] int32: rows to quantize (LIMIT_ROWS)
    K, eps, stride_xm, stride_qm,
    FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, LIMIT_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    if LIMIT_ROWS:
        if pid_m >= tl.load(num_rows_ptr):
            return
    x_row = x_ptr + pid_m * stride_xm
    q_row = q_ptr + pid_m * stride_qm
    offs_k = tl.arange(0, BLOCK_K)
    if ONE_PASS:  # the whole row in registers: read once
        mask_k = offs_k < K
        x = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        absmax = abs_no_nan(x)
    else:
        absmax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            absmax = tl.maximum(absmax, abs_no_nan(tl.load(x_row + k0 + offs_k, mask=k0 + offs_k < K,
                                                           other=0.0).to(tl.float32)))
    pdl_launch_dependents(USE_PDL)  # the row is read: the two-pass form's second pass hits L2/L1
    scale = fp8_scale(tl.max(absmax, axis=0, keep_dims=True), eps, FP8_MAX, False)  # [1]
    tl.store(s_ptr + pid_m + tl.arange(0, 1), scale)
    scale_k = tl.broadcast_to(scale, (BLOCK_K,))
    if ONE_PASS:
        tl.store(q_row + offs_k, to_fp8(x, scale_k, FP8_MAX).to(q_ptr.dtype.element_ty), mask=mask_k)
    else:
        for k0 in range(0, K, BLOCK_K):
            mask_k = k0 + offs_k < K
            x = tl.load(x_row + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs_k, to_fp8(x, scale_k, FP8_MAX).to(q_ptr.dtype.element_ty), mask=mask_k)


@triton.jit
def _static_quant_fp8_kernel(
    x_ptr,  # [rows, K] float, unit stride along K
    q_ptr,  # [rows, K] float8_e4m3fn, unit stride along K
    scale_ptr,  # [1] float32
    num_rows_ptr,  # [1] int32: rows to quantize (LIMIT_ROWS)
    K, stride_xm, stride_qm,
    FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr, LIMIT_ROWS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    if LIMIT_ROWS:
        if pid_m >= tl.load(num_rows_ptr):
            return
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    mask_k = offs_k < K
    x = tl.load(x_ptr + pid_m * stride_xm + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    scale = tl.broadcast_to(tl.load(scale_ptr), (BLOCK_K,))
    pdl_launch_dependents(USE_PDL)
    tl.store(q_ptr + pid_m * stride_qm + offs_k, to_fp8(x, scale, FP8_MAX).to(q_ptr.dtype.element_ty), mask=mask_k)


def _rows(x: object) -> torch.Tensor:
    """Check x (..., K) and return it as (rows, K): a view when the leading dims allow, else a copy."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (..., K)")
    check_last_dim_contiguous("x", x)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _row_limit(num_rows: torch.Tensor | None, x: torch.Tensor) -> dict:
    """The kernels' row-limit arguments: ``num_rows`` ((1,) int32 on x's device, checked) or none."""
    if num_rows is None:
        return dict(num_rows_ptr=x, LIMIT_ROWS=False)
    check_tensor("num_rows", num_rows, dtypes=(torch.int32,), device=x.device)
    check_shape("num_rows", num_rows, (1,))
    return dict(num_rows_ptr=num_rows, LIMIT_ROWS=True)


def _check_eps(eps: float) -> None:
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < MIN_EPS:
        raise ValueError(f"eps must be a finite float >= {MIN_EPS:.3g}, got {eps!r}")


def alloc_group_scales(shape: torch.Size, group_size: int, column_major: bool, device: torch.device) -> torch.Tensor:
    """Empty float32 scales (..., K // group_size) for x of ``shape``; column-major: the group
    index is outermost in memory (strides (1, rows) for 2-D x)."""
    lead, g = tuple(shape[:-1]), shape[-1] // group_size
    if column_major:
        return torch.empty((g, *lead), dtype=torch.float32, device=device).movedim(0, -1)
    return torch.empty((*lead, g), dtype=torch.float32, device=device)


@with_interpreter_fixes
def per_token_group_quant_fp8(
    x: torch.Tensor,
    group_size: int,
    eps: float = 1e-10,
    column_major_scales: bool = False,
    use_ue8m0: bool = False,
    out_q: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    num_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of ``group_size`` along K: scale = max(absmax, eps) / 448, q = clamp(x / scale) in fp8.

    Args:
        x: (..., K) float16/bfloat16/float32, unit stride along K; K % group_size == 0.
        group_size: elements per scale (vLLM block_k, e.g. 128).
        eps: lower bound on the absmax (>= MIN_EPS); all-zero groups get scale eps / 448.
        column_major_scales: allocate the scales group-major (strides (1, rows) for 2-D x).
        use_ue8m0: round each scale up to a power of two (DeepGEMM's UE8M0 scales).
        out_q: optional contiguous (..., K) float8_e4m3fn output.
        out_scale: optional (..., K // group_size) float32 output, any layout viewable as
            (rows, G); its own layout is used and ``column_major_scales`` is ignored.
        num_rows: optional (1,) int32 on x's device: only rows below ``num_rows[0]`` (read on the
            device) are quantized; the rest of q and the scales are not written.

    Returns:
        (q (..., K) float8_e4m3fn contiguous, scales (..., K // group_size) float32).

    Example:
        >>> q, s = per_token_group_quant_fp8(x, 128)  # x (M, 7168) bf16 -> s (M, 56)
    """
    x2 = _rows(x)
    limit = _row_limit(num_rows, x)
    rows, k = x2.shape
    if not isinstance(group_size, int) or group_size < 1 or k % group_size:
        raise ValueError(f"group_size must be a positive int dividing K={k}, got {group_size!r}")
    _check_eps(eps)
    g = k // group_size
    if out_q is None:
        out_q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    else:
        check_tensor("out_q", out_q, dtypes=FP8_DTYPES, device=x.device, contiguous=True)
        check_shape("out_q", out_q, tuple(x.shape))
    if out_scale is None:
        out_scale = alloc_group_scales(x.shape, group_size, column_major_scales, x.device)
    else:
        check_tensor("out_scale", out_scale, dtypes=(torch.float32,), device=x.device)
        check_shape("out_scale", out_scale, (*x.shape[:-1], g))
    try:
        s2 = out_scale.view(rows, g)
    except RuntimeError as err:
        raise ValueError(f"out_scale with strides {out_scale.stride()} cannot be viewed as ({rows}, {g})") from err
    if rows == 0 or g == 0:
        return out_q, out_scale
    block_s = next_power_of_2(group_size)
    block_g = min(next_power_of_2(g), max(1, TILE // block_s))
    num_warps = max(2, min(8, block_g * block_s // 512))
    launch(_per_token_group_quant_fp8_kernel, (rows, cdiv(g, block_g)),
        x2, out_q, s2, **limit, num_groups=g, group_size=group_size, eps=eps,
        stride_xm=x2.stride(0), stride_qm=k, stride_sm=s2.stride(0), stride_sg=s2.stride(1),
        FP8_MAX=FP8_MAX, USE_UE8M0=use_ue8m0, BLOCK_G=block_g, BLOCK_S=block_s, num_warps=num_warps, **pdl_args(),
    )
    return out_q, out_scale


@with_interpreter_fixes
def per_token_quant_fp8(
    x: torch.Tensor, eps: float = 1e-10, num_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token fp8: one group per row, scale = max(absmax, eps) / 448.

    Args:
        x: (..., K) float16/bfloat16/float32, unit stride along K; any K.
        eps: lower bound on the absmax (>= MIN_EPS).
        num_rows: optional (1,) int32 on x's device: only rows below ``num_rows[0]`` (read on the
            device) are quantized; the rest of q and the scales are not written.

    Returns:
        (q (..., K) float8_e4m3fn contiguous, scales (..., 1) float32).

    Example:
        >>> q, s = per_token_quant_fp8(x)  # x (M, K) -> s (M, 1)
    """
    x2 = _rows(x)
    _check_eps(eps)
    limit = _row_limit(num_rows, x)
    rows, k = x2.shape
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scales
    block_k = min(PER_TOKEN_BLOCK_K, next_power_of_2(max(k, 1)))
    launch(_per_token_quant_fp8_kernel, (rows,),
        x2, q, scales, **limit, K=k, eps=eps, stride_xm=x2.stride(0), stride_qm=k,
        FP8_MAX=FP8_MAX, BLOCK_K=block_k, ONE_PASS=block_k >= k, num_warps=min(16, max(4, block_k // 1024)),
        **pdl_args(),
    )
    return q, scales


@with_interpreter_fixes
def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor, num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Static per-tensor fp8: q = clamp(x / scale, ±448).

    Args:
        x: (..., K) float16/bfloat16/float32, unit stride along K.
        scale: one-element float32 tensor on x's device (shape () or (1,)).
        num_rows: optional (1,) int32 on x's device: only rows below ``num_rows[0]`` (read on the
            device) are quantized; the rest of the output is not written.

    Returns:
        (..., K) float8_e4m3fn, contiguous.

    Example:
        >>> q = static_quant_fp8(x, torch.tensor([0.02], device=x.device))
    """
    x2 = _rows(x)
    check_tensor("scale", scale, dtypes=(torch.float32,), device=x.device)
    if scale.numel() != 1:
        raise ValueError(f"scale must hold one element (a per-tensor scale), got shape {tuple(scale.shape)}")
    limit = _row_limit(num_rows, x)
    rows, k = x2.shape
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if rows == 0 or k == 0:
        return q
    block_k = min(1024, next_power_of_2(k))
    launch(_static_quant_fp8_kernel, (rows, cdiv(k, block_k)),
        x2, q, scale, **limit, K=k, stride_xm=x2.stride(0), stride_qm=k, FP8_MAX=FP8_MAX, BLOCK_K=block_k, num_warps=4,
        **pdl_args(),
    )
    return q
