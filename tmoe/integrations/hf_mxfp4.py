"""GPT-OSS experts loaded in mxfp4 (transformers' ``Mxfp4GptOssExperts``), kept packed for tmoe.

The checkpoint layout is ``*_blocks`` (E, rows, K / 32, 16) uint8 (two e2m1 codes per byte, even
k in the low nibble) and ``*_scales`` (E, rows, K / 32) uint8 (e8m0), gate and up rows of
``gate_up_proj`` interleaved. tmoe reads the codes as (E, rows, K / 2), a view of the blocks
(``tmoe.mxfp4_from_blocks``). On a GPU transformers loads them into triton_kernels' swizzled
tensors (``<proj>`` and ``<proj>_precision_config.weight_scale``); those are turned back with
their layout's ``unswizzle_data``, as transformers' own ``Mxfp4ReverseDeserialize`` does.
"""
from __future__ import annotations

import torch
from torch import nn

from tmoe.weights import mxfp4_from_blocks


def _unswizzled(t: object) -> torch.Tensor:
    """The (..., rows, cols) torch tensor of a triton_kernels tensor swizzled as (..., cols, rows)."""
    storage = t.storage
    return storage.layout.unswizzle_data(storage.data).transpose(-1, -2)


def packed_mxfp4(experts: nn.Module, proj: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes uint8 (E, rows, K / 2), scales uint8 (E, rows, K / 32)) of ``proj`` ("gate_up_proj"
    or "down_proj"): from the checkpoint's ``<proj>_blocks``/``<proj>_scales`` when the module
    holds them, else from transformers' swizzled triton_kernels tensors; None when it holds neither."""
    blocks, scales = getattr(experts, f"{proj}_blocks", None), getattr(experts, f"{proj}_scales", None)
    if isinstance(blocks, torch.Tensor) and isinstance(scales, torch.Tensor):
        return mxfp4_from_blocks(blocks, scales)
    weight, precision = getattr(experts, proj, None), getattr(experts, f"{proj}_precision_config", None)
    if not hasattr(weight, "storage") or not hasattr(getattr(precision, "weight_scale", None), "storage"):
        return None
    scales = _unswizzled(precision.weight_scale)
    return _unswizzled(weight).reshape(*scales.shape[:2], -1), scales


def mxfp4_mismatch(experts: nn.Module) -> str | None:
    """Why ``experts`` has no packed mxfp4 weights tmoe can read (None: it has)."""
    w1, w2 = packed_mxfp4(experts, "gate_up_proj"), packed_mxfp4(experts, "down_proj")
    if w1 is None or w2 is None:
        return "holds no packed mxfp4 weights (neither *_blocks/*_scales nor loaded triton_kernels tensors)"
    (c1, s1), (c2, s2) = w1, w2
    e, two_i, half_h = c1.shape
    i, h = two_i // 2, 2 * half_h
    want = {"gate_up_proj": (e, two_i, h // 2), "gate_up_proj_scales": (e, two_i, -(-h // 32)),
            "down_proj": (e, h, i // 2), "down_proj_scales": (e, h, -(-i // 32))}
    got = dict(zip(want, (tuple(t.shape) for t in (c1, s1, c2, s2))))
    return None if got == want and two_i % 2 == 0 else f"mxfp4 shapes {got} are not {want}"


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows (gate0, up0, gate1, ...) along dim 1 -> gate rows then up rows (a copy)."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
