"""Activation quantization by scheme: the one place that maps a FusedMoEQuantConfig to a quant kernel."""
from __future__ import annotations

import torch

from tmoe.kernels.quant import per_token_group_quant_fp8, per_token_quant_fp8, static_quant_fp8
from tmoe.modular.quant_config import FusedMoEQuantConfig


def quantize_activations(
    x: torch.Tensor, quant_config: FusedMoEQuantConfig, static_scale: torch.Tensor | None = None,
    num_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize ``x`` (..., K) as ``quant_config`` says; returns (x_q, scale) or (x, None) unquantized.

    Scales: static per-tensor ``static_scale`` (1 element) when given; else dynamic per token
    (..., 1) for "token" and "tensor" schemes (per-token scales are at least as accurate as one
    per-tensor scale and need no global reduction), or per 1 x block_k group (..., K / block_k).
    ``num_rows`` ((1,) int32, read on the device): quantize only the rows below it (x's rows are
    the grouped route's worst-case padded count; the rest are never read).
    """
    scheme = quant_config.scheme
    if scheme == "none":
        return x, None
    if scheme == "block":
        if static_scale is not None:
            raise ValueError("static activation scales are not supported with block quantization")
        return per_token_group_quant_fp8(x, quant_config.block_shape[1], num_rows=num_rows)
    if static_scale is not None:
        return static_quant_fp8(x, static_scale, num_rows), static_scale
    return per_token_quant_fp8(x, num_rows=num_rows)
