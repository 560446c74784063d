"""Setup-time weight quantization in plain torch, in the layouts of vLLM checkpoints.

fp8 (e4m3fn): per output channel (E, N, 1), per 128x128 block (E, cdiv(N, 128), cdiv(K, 128)),
per tensor (E,). Scales are float32 ``max(absmax, eps) / 448``; q = clamp(w / scale, ±448).

Weight-only low-bit (``FusedMoEQuantConfig(weight_dtype=...)``; layouts of vLLM's
``fused_moe_kernel_gptq_awq`` and of GPT-OSS's mxfp4): int4 and int8 codes with one scale (in w's
dtype) and optionally one zero point per ``group_size`` values along K; mxfp4 e2m1 codes with one
e8m0 scale byte per 32 values. 4-bit codes are packed two per byte along K, even k low."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tmoe.kernels.checks import FLOAT_DTYPES, check_tensor
from tmoe.kernels.sizes import cdiv
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


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(..., 2J) codes in [0, 16) -> (..., J) uint8, even index in the low nibble."""
    pairs = q.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] + pairs[..., 1] * 16


def _groups(wf: torch.Tensor, group_size: int) -> torch.Tensor:
    """(E, N, K) -> (E, N, cdiv(K, g), g), the ragged last group padded by repeating its first value
    (so padding changes neither its min nor its max)."""
    k = wf.shape[-1]
    pad = cdiv(k, group_size) * group_size - k
    if pad:
        last = wf[..., (k // group_size) * group_size:(k // group_size) * group_size + 1]
        wf = torch.cat([wf, last.expand(*wf.shape[:-1], pad)], dim=-1)
    return wf.unflatten(-1, (-1, group_size))


def _quantize_int(w: torch.Tensor, group_size: int, zero_point: bool, bits: int):
    wf = _check_weight(w)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    e, n, k = wf.shape
    if bits == 4 and (k % 2 or (zero_point and n % 2)):
        raise ValueError(f"int4 packs two values per byte along K (and zero points two rows per byte): "
                         f"w must have even K and N, got shape {tuple(w.shape)}")
    qmax = (1 << bits) - 1
    g = _groups(wf, group_size)  # [E, N, G, g]
    if zero_point:  # asymmetric: the group's [min, max] (with 0) onto [0, qmax]
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / qmax).clamp(min=1e-10).to(w.dtype)
        zp = (-lo / scale.float()).round().clamp(0, qmax)
    else:  # symmetric around the implicit zero point 2^(bits - 1)
        scale = (g.abs().amax(-1) / ((1 << (bits - 1)) - 1)).clamp(min=1e-10).to(w.dtype)
        zp = torch.full_like(scale, 1 << (bits - 1), dtype=torch.float32)
    q = (g / scale.float()[..., None]).round() + zp[..., None]
    q = q.clamp(0, qmax).flatten(-2)[..., :k].to(torch.uint8)  # [E, N, K]
    zp = zp.to(torch.uint8) if zero_point else None
    if bits == 4:
        q = _pack_nibbles(q)
        zp = _pack_nibbles(zp.transpose(1, 2)).transpose(1, 2).contiguous() if zp is not None else None
    return q.contiguous(), scale.contiguous(), zp


def quantize_weight_int4(w: torch.Tensor, group_size: int, zero_point: bool = True):
    """w (E, N, K) float -> (q uint8 (E, N, K / 2), scale (E, N, cdiv(K, g)) in w's dtype, zero
    point uint8 (E, N / 2, cdiv(K, g)) or None). value = (q - zp) * scale, q and zp in [0, 16);
    without zero points the scale is absmax / 7 and zp = 8. K (and N with zero points) even."""
    return _quantize_int(w, group_size, zero_point, 4)


def quantize_weight_int8(w: torch.Tensor, group_size: int, zero_point: bool = True):
    """w (E, N, K) float -> (q uint8 (E, N, K), scale (E, N, cdiv(K, g)) in w's dtype, zero point
    uint8 (E, N, cdiv(K, g)) or None). value = (q - zp) * scale; without zero points the scale is
    absmax / 127 and zp = 128."""
    return _quantize_int(w, group_size, zero_point, 8)


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def quantize_weight_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, N, K) float, K even -> (q uint8 (E, N, K / 2) two e2m1 codes per byte, even k low;
    scale uint8 (E, N, cdiv(K, 32)) e8m0). Each block of 32 is scaled by 2^ceil(log2(absmax / 6)),
    the smallest power of two at which no value saturates (OCP MX's floor(log2(absmax)) - 2 clips
    values above 6 · scale), and rounded to the nearest e2m1 value."""
    wf = _check_weight(w)
    e, n, k = wf.shape
    if k % 2:
        raise ValueError(f"mxfp4 packs two values per byte along K: w must have even K, got shape {tuple(w.shape)}")
    g = _groups(wf, 32)  # [E, N, G, 32]
    absmax = g.abs().amax(-1)
    exponent = torch.where(absmax > 0, torch.ceil(torch.log2(absmax / 6)), torch.full_like(absmax, -127))
    exponent = exponent.clamp(-127, 127)
    v = (g / torch.exp2(exponent)[..., None]).flatten(-2)[..., :k]  # [E, N, K]
    grid = torch.tensor(_E2M1, device=w.device)
    code = (v.abs()[..., None] - grid).abs().argmin(-1)  # nearest magnitude (ties: the smaller)
    code = code + 8 * ((v < 0) & (code > 0))
    return _pack_nibbles(code).contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def mxfp4_from_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's transformers layout to tmoe's, without a copy: ``*_blocks`` (E, rows, K / 32, 16)
    uint8 -> (E, rows, K / 2), a view; ``*_scales`` (E, rows, K / 32) uint8 unchanged."""
    check_tensor("blocks", blocks, dtypes=(torch.uint8,), ndim=4)
    check_tensor("scales", scales, dtypes=(torch.uint8,), ndim=3)
    if blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(f"blocks (E, rows, K / 32, 16) and scales (E, rows, K / 32) expected, got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    return blocks.flatten(2), scales
