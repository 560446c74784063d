"""How activations and weights are quantized: a frozen value with a primitive form for op schemas."""
from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_DTYPES = ("int4", "int8", "mxfp4")


@dataclass(frozen=True)
class FusedMoEQuantConfig:
    """How activations and weights are quantized. ``quant_dtype=None``: no quantization.
    fp8: per-tensor by default; ``per_act_token_quant`` (one activation scale per token),
    ``per_out_ch_quant`` (one weight scale per output channel), or ``block_shape=[bn, bk]``
    (activation groups of bk along K, weight blocks bn x bk).

    Weight-only low-bit (activations stay in their float dtype, ``quant_dtype=None``):
    ``weight_dtype`` "int4" or "int8" with one scale (and optional zero point) per
    ``group_size`` values along K (a power of two >= 16), or "mxfp4" (group_size 32)."""

    quant_dtype: torch.dtype | None = None
    per_act_token_quant: bool = False
    per_out_ch_quant: bool = False
    block_shape: tuple[int, int] | None = None
    weight_dtype: str | None = None
    group_size: int = 0

    def __post_init__(self) -> None:
        self._check_weight_only()
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

    def _check_weight_only(self) -> None:
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int):
            raise TypeError(f"group_size must be an int, got {g!r}")
        if self.weight_dtype is None:
            if g:
                raise ValueError(f"group_size={g} needs a weight_dtype (int4, int8 or mxfp4)")
            return
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be None or one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}")
        if self.quant_dtype is not None or self.per_act_token_quant or self.per_out_ch_quant or self.block_shape:
            raise ValueError(f"weight_dtype={self.weight_dtype!r} is weight-only: quant_dtype must be None and "
                             f"the fp8 options unset")
        if self.weight_dtype == "mxfp4":
            if g not in (0, 32):
                raise ValueError(f"mxfp4 has one scale per 32 values: group_size must be 32 (or 0), got {g}")
            object.__setattr__(self, "group_size", 32)
        elif g < 16 or g & (g - 1):
            raise ValueError(f"{self.weight_dtype} weights need group_size, a power of two >= 16, got {g}")

    @property
    def quant_name(self) -> str | None:
        """vLLM's dtype name of the scheme (tuned tables): fp8_w8a8, int4_w4a16, int8_w8a16, mxfp4_w4a16."""
        if self.weight_dtype is not None:
            return f"{self.weight_dtype}_w{8 if self.weight_dtype == 'int8' else 4}a16"
        return None if self.quant_dtype is None else "fp8_w8a8"

    @property
    def dtype_name(self) -> str | None:
        """``quant_dtype``'s name ("float8_e4m3fn"), as the layer op's schema takes it; None unquantized."""
        return None if self.quant_dtype is None else str(self.quant_dtype).removeprefix("torch.")

    @property
    def scheme(self) -> str:
        """"none", "tensor", "token" (per-token activations) or "block"."""
        if self.quant_dtype is None:
            return "none"
        if self.block_shape is not None:
            return "block"
        return "token" if self.per_act_token_quant else "tensor"

    def as_args(self) -> tuple[str | None, bool, bool, list[int] | None, str | None, int]:
        """Primitive form for custom-op arguments."""
        return (self.dtype_name, self.per_act_token_quant, self.per_out_ch_quant,
                list(self.block_shape) if self.block_shape else None, self.weight_dtype, self.group_size)

    @classmethod
    def from_args(cls, dtype: str | None, per_act_token: bool, per_out_ch: bool, block_shape: list[int] | None,
                  weight_dtype: str | None = None, group_size: int = 0):
        return cls(getattr(torch, dtype) if dtype else None, per_act_token, per_out_ch,
                   tuple(block_shape) if block_shape else None, weight_dtype, group_size)
