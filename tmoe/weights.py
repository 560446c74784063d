"""Setup-time fp8 (e4m3fn) weight quantization in plain torch, in the scale layouts of vLLM
checkpoints: per output channel (E, N, 1), per 128x128 block (E, cdiv(N, 128), cdiv(K, 128)),
per tensor (E,). Scales are float32 ``max(absmax, eps) / 448``; q = clamp(w / scale, ±448)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tmoe.kernels.checks import FLOAT_DTYPES, check_tensor
from tmoe.kernels.common import cdiv
from tmoe.kernels.quant import FP8_DTYPE, FP8_MAX


def _check_weight(w: torch.Tensor) -> torch.Tensor:
    """w (E, N, K) float with N, K > 0, as float32."""
    check_tensor("w", w, dtypes=FLOAT_DTYPES, ndim=3)
    if w.shape[1] == 0 or w.shape[2] == 0:
        raise ValueError(f"w must have N, K > 0, got shape {tuple(w.shape)}")
    return w.float()


def _scale(absmax: torch.Tensor, eps: float) -> torch.Tensor:
    # a tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal
    return absmax.clamp(min=eps) / absmax.new_full((), FP8_MAX)


def _cast(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight_per_channel_fp8(w: torch.Tensor, eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, N, K) -> (fp8 (E, N, K), float32 scale (E, N, 1)): one scale per output channel."""
    wf = _check_weight(w)
    scale = _scale(wf.abs().amax(dim=-1, keepdim=True), eps)
    return _cast(wf, scale), scale


def quantize_weight_per_block_fp8(
    w: torch.Tensor, block_shape: tuple[int, int] = (128, 128), eps: float = 1e-10
) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, N, K) -> (fp8 (E, N, K), float32 scale (E, cdiv(N, bn), cdiv(K, bk))) for
    ``block_shape = (bn, bk)``; ragged edge blocks are zero-padded for the absmax."""
    wf = _check_weight(w)
    bn, bk = block_shape
    if bn < 1 or bk < 1:
        raise ValueError(f"block_shape must be positive, got {block_shape}")
    e, n, k = wf.shape
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    blocks = F.pad(wf, (0, kb * bk - k, 0, nb * bn - n)).view(e, nb, bn, kb, bk)
    scale = _scale(blocks.abs().amax(dim=(2, 4)), eps)  # [E, nb, kb]
    q = _cast(blocks, scale[:, :, None, :, None]).view(e, nb * bn, kb * bk)
    return q[:, :n, :k].contiguous(), scale


def quantize_weight_per_tensor_fp8(w: torch.Tensor, eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, N, K) -> (fp8 (E, N, K), float32 scale (E,)): one scale per expert."""
    wf = _check_weight(w)
    scale = _scale(wf.abs().amax(dim=(1, 2)), eps)
    return _cast(wf, scale[:, None, None]), scale
