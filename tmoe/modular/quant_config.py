"""How activations and weights are quantized: a frozen value with a primitive form for op schemas."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FusedMoEQuantConfig:
    """How activations and weights are quantized. ``quant_dtype=None``: no quantization.
    fp8: per-tensor by default; ``per_act_token_quant`` (one activation scale per token),
    ``per_out_ch_quant`` (one weight scale per output channel), or ``block_shape=[bn, bk]``
    (activation groups of bk along K, weight blocks bn x bk)."""

    quant_dtype: torch.dtype | None = None
    per_act_token_quant: bool = False
    per_out_ch_quant: bool = False
    block_shape: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.block_shape is not None:
            bs = tuple(self.block_shape)
            if len(bs) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bs):
                raise ValueError(f"block_shape must be [block_n, block_k] of positive ints, got {self.block_shape!r}")
            if bs[1] < 16 or bs[1] & (bs[1] - 1):
                raise ValueError(f"block_shape[1] (block_k, the activation group size) must be a power of two "
                                 f">= 16, got {bs[1]}")
            object.__setattr__(self, "block_shape", bs)
        for name in ("per_act_token_quant", "per_out_ch_quant"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.quant_dtype not in (None, torch.float8_e4m3fn):
            raise ValueError(f"quant_dtype must be None or torch.float8_e4m3fn, got {self.quant_dtype}")
        if self.quant_dtype is None and (self.per_act_token_quant or self.per_out_ch_quant or self.block_shape):
            raise ValueError("per-token, per-channel and block options need quant_dtype=torch.float8_e4m3fn")
        if self.block_shape is not None and (self.per_act_token_quant or self.per_out_ch_quant):
            raise ValueError("block_shape excludes per_act_token_quant and per_out_ch_quant")

    @property
    def scheme(self) -> str:
        """"none", "tensor", "token" (per-token activations) or "block"."""
        if self.quant_dtype is None:
            return "none"
        if self.block_shape is not None:
            return "block"
        return "token" if self.per_act_token_quant else "tensor"

    def as_args(self) -> tuple[str | None, bool, bool, list[int] | None]:
        """Primitive form for custom-op arguments."""
        dtype = None if self.quant_dtype is None else str(self.quant_dtype).removeprefix("torch.")
        return dtype, self.per_act_token_quant, self.per_out_ch_quant, list(self.block_shape) if self.block_shape else None

    @classmethod
    def from_args(cls, dtype: str | None, per_act_token: bool, per_out_ch: bool, block_shape: list[int] | None):
        return cls(getattr(torch, dtype) if dtype else None, per_act_token, per_out_ch,
                   tuple(block_shape) if block_shape else None)
