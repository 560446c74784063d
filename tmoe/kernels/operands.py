"""The expert GEMMs' operands: fp8 scales, low-bit weight scales and zero points, where a GEMM
finds its rows (``Routing``, ``DirectRouting``), and the operand checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tmoe.kernels.checks import FLOAT_DTYPES, FP8_DTYPES, check_shape, check_tensor
from tmoe.kernels.sizes import cdiv


@dataclass(frozen=True)
class Scales:
    """fp8 dequantization scales. ``block_shape`` None: a_scale has 1 or rows elements
    (per-tensor / per-token), w_scale (E,) or (E, N_w[, 1]) (per-tensor / per-channel).
    ``[bn, bk]``: a_scale (rows, cdiv(K, bk)), w_scale (E, cdiv(N_w, bn), cdiv(K, bk))."""

    a_scale: torch.Tensor
    w_scale: torch.Tensor
    block_shape: tuple[int, int] | None = None


@dataclass(frozen=True)
class WeightScales:
    """Weight-only low-bit dequantization (activations unquantized), vLLM's layouts for W of
    logical shape (E, rows, K): ``weight_dtype`` "int4" (W uint8 (E, rows, K / 2), two values per
    byte, even k low), "int8" (W uint8 (E, rows, K)) or "mxfp4" (e2m1 packed as int4).
    ``scale`` (E, rows, cdiv(K, group_size)): float (int4/int8), uint8 e8m0 (mxfp4).
    ``zero_point`` (int4: uint8 (E, rows / 2, groups), two rows per byte, even row low;
    int8: uint8 (E, rows, groups)); None: 8 (int4), 128 (int8). value = (q - zp) * scale."""

    weight_dtype: str
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    group_size: int


@dataclass(frozen=True)
class BlockScales:
    """Frozen block-fp8 expert weights as the backward kernels read them: w1 (E, rows, K) and w2
    (E, K, N) float8_e4m3fn, w = q * scale per (bn x bk) block: ``w1_scale`` (E, cdiv(rows, bn),
    cdiv(K, bk)), ``w2_scale`` (E, cdiv(K, bn), cdiv(N, bk)) float32; ``block_shape`` (bn, bk)."""

    w1_scale: torch.Tensor
    w2_scale: torch.Tensor
    block_shape: tuple[int, int]

    @classmethod
    def of(cls, w1: torch.Tensor, w2: torch.Tensor, w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
           block_shape: Sequence[int] | None) -> BlockScales | None:
        """The value for fp8 weights with their scales (checked), or None for float weights."""
        if block_shape is None and w1_scale is None and w2_scale is None and w1.dtype not in FP8_DTYPES:
            return None
        if block_shape is None or len(block_shape) != 2:
            raise ValueError(f"fp8 weights need block_shape [bn, bk] for their scales, got {block_shape}")
        bn, bk = block_shape
        for name, w, scale in (("w1", w1, w1_scale), ("w2", w2, w2_scale)):
            if w.dtype not in FP8_DTYPES:
                raise TypeError(f"{name} must be float8_e4m3fn with block scales, got {w.dtype}")
            want = (w.shape[0], cdiv(w.shape[1], bn), cdiv(w.shape[2], bk))
            check_shape(f"{name}_scale", check_tensor(f"{name}_scale", scale, dtypes=(torch.float32,), ndim=3), want)
        return cls(w1_scale, w2_scale, (bn, bk))


def scale_strides(scale: torch.Tensor) -> tuple[int, int, int]:
    """The (expert, row block, column block) strides of a 3-D block-scale tensor (0s for another)."""
    return tuple(scale.stride()) if scale.dim() == 3 else (0, 0, 0)


@dataclass(frozen=True)
class Routing:
    """Where a Standard-format GEMM finds its rows: the align stage's outputs."""

    sorted_token_ids: torch.Tensor  # [EM] int32
    expert_ids: torch.Tensor  # [EM // block_m] int32
    num_tokens_post_padded: torch.Tensor  # [1] int32
    num_slots: int  # M * topk; the sentinel value in sorted_token_ids
    a_row_div: int  # slot // a_row_div is the row of A: topk for (M, K) inputs, 1 for per-slot inputs


@dataclass(frozen=True)
class DirectRouting:
    """Standard-format rows without the align stage: slot s is row s // a_row_div of A and its
    expert is ``topk_ids[s]`` (mapped through ``expert_map``; an id out of range, or mapped outside
    [0, E_local) with E_local the weights' expert count: zero)."""

    topk_ids: torch.Tensor  # [M, topk] int32/int64, contiguous
    num_experts: int  # global expert count
    expert_map: torch.Tensor | None = None  # [num_experts] int32
    a_row_div: int = 1


def codes_per_byte(weight_dtype: str | None) -> int:
    """Weight values per stored element along K: 2 for the 4-bit schemes (int4, mxfp4), 1 for int8
    and for unpacked weights (None)."""
    return 1 if weight_dtype in (None, "int8") else 2


def logical_cols(w: torch.Tensor, weight_dtype: str | None) -> int:
    """The logical size of W's (E, rows, cols) last dimension: stored columns times ``codes_per_byte``."""
    return w.shape[2] * codes_per_byte(weight_dtype)


def check_gemm_operands(a_name: str, a: torch.Tensor, w_name: str, w: torch.Tensor, k_dim: str) -> None:
    """``a`` (..., K) and ``w`` (E, N_w, K) on one device, float or fp8 (both or neither)."""
    dtypes = FLOAT_DTYPES + FP8_DTYPES
    check_tensor(a_name, a, dtypes=dtypes)
    check_tensor(w_name, w, dtypes=dtypes, ndim=3, device=a.device)
    if (a.dtype in FP8_DTYPES) != (w.dtype in FP8_DTYPES):
        raise TypeError(f"{a_name} ({a.dtype}) and {w_name} ({w.dtype}) must both be fp8 or both not")
    if a.dtype not in FP8_DTYPES and a.dtype != w.dtype:
        raise TypeError(f"{a_name} ({a.dtype}) and {w_name} ({w.dtype}) must have the same dtype")
    if a.shape[-1] != w.shape[2]:
        raise ValueError(f"{a_name} has {k_dim}={a.shape[-1]} but {w_name} has {w.shape[2]} in its last dimension")


def check_low_bit_operand(name: str, w: torch.Tensor, scale_name: str, scale: torch.Tensor | None, zp_name: str,
                          zp: torch.Tensor | None, weight_dtype: str, group_size: int, shape: tuple[int, int, int],
                          device: torch.device, hint: str = "") -> None:
    """Low-bit weights of logical ``shape`` (E, rows, K_in) (layouts: ``WeightScales``): ``w``
    uint8 (E, rows, K_in / p) codes, p = 2 for the 4-bit schemes; ``scale`` (E, rows,
    cdiv(K_in, group_size)), float (e8m0 uint8 for mxfp4); ``zp`` None or uint8 (E, rows / p,
    groups), int only. ``hint`` ends the shape error (what K_in comes from)."""
    e, rows, k_in = shape
    pack = codes_per_byte(weight_dtype)
    if k_in % pack:
        raise ValueError(f"{weight_dtype} packs {pack} values per byte along {name}'s last dimension{hint}: "
                         f"K_in={k_in} must be a multiple of {pack}")
    check_tensor(name, w, dtypes=(torch.uint8,), ndim=3, device=device)
    if tuple(w.shape) != (e, rows, k_in // pack):
        raise ValueError(f"{name} must be {weight_dtype} codes of shape {(e, rows, k_in // pack)} (packed {pack} per "
                         f"byte along its last dimension){hint}; got {tuple(w.shape)}")
    if scale is None:
        raise ValueError(f"{weight_dtype} experts need {scale_name}")
    check_tensor(scale_name, scale, dtypes=(torch.uint8,) if weight_dtype == "mxfp4" else FLOAT_DTYPES, ndim=3,
                 device=device)
    groups = cdiv(k_in, group_size)
    check_shape(scale_name, scale, (e, rows, groups))
    if zp is None:
        return
    if weight_dtype == "mxfp4":
        raise ValueError(f"mxfp4 weights have no zero points; got {zp_name}")
    if rows % pack:
        raise ValueError(f"int4 zero points pack two rows per byte: {name} needs an even row count, got {rows}")
    check_tensor(zp_name, zp, dtypes=(torch.uint8,), ndim=3, device=device)
    check_shape(zp_name, zp, (e, rows // pack, groups))


def operand_scales(a_scale: torch.Tensor | None, w_scale: torch.Tensor | None, block_shape: Sequence[int] | None,
                   w_zp: torch.Tensor | None, weight_dtype: str | None, group_size: int, *, fp8: bool,
                   missing: str) -> Scales | WeightScales | None:
    """The scales one GEMM takes: ``WeightScales`` for low-bit weights (``weight_dtype``), ``Scales``
    for fp8 operands (``fp8``; ``missing`` is the error when a scale is absent), else None."""
    if weight_dtype is not None:
        return WeightScales(weight_dtype, w_scale, w_zp, group_size)
    if not fp8:
        return None
    if a_scale is None or w_scale is None:
        raise ValueError(missing)
    return Scales(a_scale, w_scale, tuple(block_shape) if block_shape else None)
