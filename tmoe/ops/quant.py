"""The fp8 quantization ops ``torch.ops.tmoe.{per_token_group,per_token,static}_quant_fp8`` and
their fakes (inference-only: no gradient flows through a quantization)."""
from __future__ import annotations

import torch

from tmoe.kernels.checks import FLOAT_DTYPES, check_tensor
from tmoe.kernels.quant import (
    FP8_DTYPE,
    alloc_group_scales,
    per_token_group_quant_fp8 as _per_token_group_quant_fp8,
    per_token_quant_fp8 as _per_token_quant_fp8,
    static_quant_fp8 as _static_quant_fp8,
)
from tmoe.ops.autograd import inference_only


def _check_quant_input(x: torch.Tensor) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (..., K)")


@torch.library.custom_op("tmoe::per_token_group_quant_fp8", mutates_args=())
def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int, eps: float = 1e-10, column_major_scales: bool = False, use_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) fp8 codes and (..., K // group_size) float32 scales, one per group along K."""
    return _per_token_group_quant_fp8(x, group_size, eps, column_major_scales, use_ue8m0)


@per_token_group_quant_fp8.register_fake
def _(x, group_size, eps=1e-10, column_major_scales=False, use_ue8m0=False):
    _check_quant_input(x)
    if group_size < 1 or x.shape[-1] % group_size:
        raise ValueError(f"group_size must be a positive int dividing K={x.shape[-1]}, got {group_size}")
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    return q, alloc_group_scales(x.shape, group_size, column_major_scales, x.device)


@torch.library.custom_op("tmoe::per_token_quant_fp8", mutates_args=())
def per_token_quant_fp8(x: torch.Tensor, eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) fp8 codes and (..., 1) float32 per-token scales."""
    return _per_token_quant_fp8(x, eps)


@per_token_quant_fp8.register_fake
def _(x, eps=1e-10):
    _check_quant_input(x)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    return q, torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)


@torch.library.custom_op("tmoe::static_quant_fp8", mutates_args=())
def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(..., K) fp8 codes of x / scale, ``scale`` one float32 element."""
    return _static_quant_fp8(x, scale)


@static_quant_fp8.register_fake
def _(x, scale):
    _check_quant_input(x)
    check_tensor("scale", scale, dtypes=(torch.float32,), device=x.device)
    if scale.numel() != 1:
        raise ValueError(f"scale must hold one element (a per-tensor scale), got shape {tuple(scale.shape)}")
    return torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)


for _op in (per_token_group_quant_fp8, per_token_quant_fp8, static_quant_fp8):
    inference_only(_op)
