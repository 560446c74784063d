"""Launch arguments of the expert GEMM kernels: the strides of fp8 scales and low-bit weight scales
and zero points, the shared-memory fit of a tile config, the weights' TMA descriptor and storage
order (operands:
``tmoe.kernels.operands``; device queries: ``tmoe.runtime.device``)."""
from __future__ import annotations

from dataclasses import replace

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from tmoe.kernels.checks import check_tensor
from tmoe.kernels.sizes import cdiv
from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels.operands import Scales, WeightScales, codes_per_byte
from tmoe.runtime.device import EPILOGUE_MARGIN, SHARED_MEMORY_BUDGET, is_sm90
from tmoe.runtime.interpreter import INTERPRETED


def _no_zero_point(w: torch.Tensor) -> dict:
    return dict(w_zp_ptr=w, stride_zpe=0, stride_zpn=0, stride_zpk=0, HAS_ZP=False)


def _weight_scale_args(ws: WeightScales, a: torch.Tensor, w: torch.Tensor) -> dict:
    """Launch arguments of low-bit weights; shapes were checked by the caller (the layer checks)."""
    s, zp = ws.scale, ws.zero_point
    args = dict(a_scale_ptr=s, w_scale_ptr=s, stride_ase=0, stride_asm=0, stride_ask=0, stride_wse=s.stride(0),
                stride_wsn=s.stride(1), stride_wsk=s.stride(2), GROUP_N=1, GROUP_K=ws.group_size,
                QUANT=ws.weight_dtype, **_no_zero_point(w))
    if zp is not None:
        args.update(w_zp_ptr=zp, stride_zpe=zp.stride(0), stride_zpn=zp.stride(1), stride_zpk=zp.stride(2),
                    HAS_ZP=True)
    return args


def fit_low_bit(config: GemmConfig, scales: Scales | WeightScales | None) -> GemmConfig:
    """Low-bit weights load their bytes by pointers (the kernel unpacks them): no TMA. Any block_k
    fits: block_k and the group size are powers of two, so one divides the other (dequant.py)."""
    if not isinstance(scales, WeightScales) or not config.tma:
        return config
    return replace(config, tma=False, persistent=False)


def asm_unpack(scales: Scales | WeightScales | None, a: torch.Tensor, config: GemmConfig, tile_n: int) -> bool:
    """Whether the kernel unpacks 4-bit codes with PTX (``dequant.packed_values``): bf16/fp16
    activations on an sm_90+ NVIDIA GPU (not the interpreter), and a [block_k / 2, tile_n] code tile
    of at least four bytes per thread (the PTX takes four at a time)."""
    if not isinstance(scales, WeightScales) or scales.weight_dtype == "int8" or a.dtype == torch.float32:
        return False
    if INTERPRETED or a.device.type != "cuda" or (config.block_k // 2) * tile_n < 4 * 32 * config.num_warps:
        return False
    return is_sm90(a.device)


def scale_args(
    scales: Scales | WeightScales | None, a: torch.Tensor, w: torch.Tensor, config: GemmConfig, tile_n: int,
    batched: bool = False,
) -> dict:
    """Launch arguments of the scales (and ``ASM_UNPACK``) of a GEMM whose B tile is
    [block_k, tile_n] weight columns; ``batched``: the BATCHED route's (E, capacity, ...) rows."""
    return {**_scale_args(scales, a, w, config, batched), "ASM_UNPACK": asm_unpack(scales, a, config, tile_n)}


def _scale_args(scales: Scales | WeightScales | None, a: torch.Tensor, w: torch.Tensor, config: GemmConfig,
                batched: bool) -> dict:
    if isinstance(scales, WeightScales):
        return _weight_scale_args(scales, a, w)
    if scales is None:  # the kernel reads no scale: w stands in for the pointers
        return dict(a_scale_ptr=w, w_scale_ptr=w, stride_ase=0, stride_asm=0, stride_ask=0,
                    stride_wse=0, stride_wsn=0, stride_wsk=0, GROUP_N=1, GROUP_K=1, QUANT="none", **_no_zero_point(w))
    a_s, w_s = scales.a_scale, scales.w_scale
    check_tensor("a_scale", a_s, dtypes=(torch.float32,), device=a.device)
    check_tensor("w_scale", w_s, dtypes=(torch.float32,), device=a.device)
    e, n_w, k = w.shape
    if scales.block_shape is not None:
        gn, gk = scales.block_shape
        if gk % config.block_k:
            raise ValueError(f"block_shape[1]={gk} must be a multiple of block_k={config.block_k}")
        want_a = (*a.shape[:-1], cdiv(k, gk))
        want_w = (e, cdiv(n_w, gn), cdiv(k, gk))
        if tuple(a_s.shape) != want_a:
            raise ValueError(f"a_scale must have shape {want_a} for block quantization, got {tuple(a_s.shape)}")
        if tuple(w_s.shape) != want_w:
            raise ValueError(f"w_scale must have shape {want_w} for block quantization, got {tuple(w_s.shape)}")
        a_st = (a_s.stride(0) if batched else 0, a_s.stride(-2), a_s.stride(-1))
        w_st = w_s.stride()
        return dict(a_scale_ptr=a_s, w_scale_ptr=w_s, stride_ase=a_st[0], stride_asm=a_st[1], stride_ask=a_st[2],
                    stride_wse=w_st[0], stride_wsn=w_st[1], stride_wsk=w_st[2], GROUP_N=gn, GROUP_K=gk, QUANT="block",
                    **_no_zero_point(w))
    if a_s.numel() == 1:
        a_st = (0, 0)
    elif a_s.numel() == a.numel() // a.shape[-1]:
        a_st = (a_s.stride(0), a_s.stride(1)) if batched else (0, a_s.stride(0))
    else:
        raise ValueError(f"a_scale must have 1 or {a.numel() // a.shape[-1]} (one per row) elements, got {a_s.numel()}")
    if w_s.numel() == e:
        w_st = (w_s.stride(0), 0)
    elif w_s.numel() == e * n_w:
        w_st = (w_s.stride(0), w_s.stride(1))
    else:
        raise ValueError(f"w_scale must have {e} (per tensor) or {e * n_w} (per channel) elements, got {w_s.numel()}")
    return dict(a_scale_ptr=a_s, w_scale_ptr=w_s, stride_ase=a_st[0], stride_asm=a_st[1], stride_ask=0,
                stride_wse=w_st[0], stride_wsn=w_st[1], stride_wsk=0, GROUP_N=1, GROUP_K=1, QUANT="scaled",
                **_no_zero_point(w))


def weight_bytes(scales: Scales | WeightScales | None, w: torch.Tensor) -> float:
    """Bytes a weight value takes in a staged B tile: low-bit codes their packed share of a byte,
    else ``w``'s element size (fp8, float)."""
    if isinstance(scales, WeightScales):
        return 1 / codes_per_byte(scales.weight_dtype)
    return w.element_size()


def fit_shared_memory(
    config: GemmConfig, elem_size: int, gated: bool, budget: int = SHARED_MEMORY_BUDGET,
    weight_size: float | None = None,
) -> GemmConfig:
    """Fewer pipeline stages, then a smaller block_k, until the staged A tiles (``elem_size``
    bytes a value) and B tiles (``weight_size``, default ``elem_size``: see ``weight_bytes``) fit in
    ``budget`` bytes (block_m and block_n stay: the align stage and the epilogue depend on them)."""
    tile_n = config.block_n * (2 if gated else 1)
    w_size = elem_size if weight_size is None else weight_size

    def need(stages: int, block_k: int) -> float:
        return stages * block_k * (config.block_m * elem_size + tile_n * w_size)

    stages, block_k = config.num_stages, config.block_k
    while need(stages, block_k) > budget and stages > 2:
        stages -= 1
    while need(stages, block_k) > budget and block_k > 16:
        block_k //= 2
    if (stages, block_k) == (config.num_stages, config.block_k):
        return config
    return replace(config, num_stages=stages, block_k=block_k)


def persistent_epilogue_bytes(config: GemmConfig, out_elem_size: int) -> int:
    """Shared memory a persistent config needs beyond EPILOGUE_MARGIN: the [block_m, block_n] output
    tile its epilogue may stage while the tile loop keeps the pipeline buffers live (as measured
    for the flattened loop in the sm_90 compile: +32 KB for a 128 x 128 bf16 tile; kept for the
    plain loop, which was timed with it); 0 for other configs."""
    if not config.persistent:
        return 0
    return max(0, config.block_m * config.block_n * out_elem_size - EPILOGUE_MARGIN)


def tma_addressable(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address ``t``: last dimension contiguous, base and every other
    stride 16-byte aligned."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1])


def weight_descriptor(w: torch.Tensor, config: GemmConfig) -> TensorDescriptor | None:
    """A TMA descriptor of ``w`` (E, N_w, K) with block [1, block_n, block_k] when ``config.tma``
    asks for one (and no ``swap_ab``, a pointer-path option) and TMA can address ``w`` (K contiguous,
    16-byte aligned base and strides); None means pointer loads."""
    if not config.tma or config.swap_ab or not tma_addressable(w):
        return None
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [1, config.block_n, config.block_k])


def stored_transposed(w: torch.Tensor) -> bool:
    """A weight (E, rows, cols) read as the transpose of its storage (transformers' GPT-OSS keeps
    (E, K, 2N)): its rows are the contiguous dimension."""
    return w.stride(1) == 1 and w.stride(2) != 1


def up_in_halves(w1: torch.Tensor, gated: bool, interleaved: bool) -> bool:
    """Whether the up GEMM reads W1's gate rows and up rows as two contiguous runs (``HALVES``,
    ``common.w1_columns``): gate rows then up rows, stored transposed (alternating rows would
    not coalesce along the contiguous dimension)."""
    return gated and not interleaved and stored_transposed(w1)


def uniform_w_scale(scales: Scales | None, n: int, block_n: int, gated: bool) -> bool:
    """Block quantization where every [block_n] tile of weight rows (gate and up tiles of W1 start
    at n) lies inside one group: one scale per tile and K group."""
    if scales is None or scales.block_shape is None:
        return False
    gn = scales.block_shape[0]
    return gn % block_n == 0 and (not gated or n % gn == 0)


def fused_quant_group(n: int, num_groups: int, config: GemmConfig, gated: bool) -> int:
    """The group size of an epilogue-quantized up GEMM with ``num_groups`` scales per row of
    ``n`` columns; ValueError unless gated and the group divides both ``n`` and ``config.block_n``."""
    group = n // num_groups if num_groups else 0
    if not gated or group == 0 or group * num_groups != n or config.block_n % group:
        raise ValueError(f"epilogue quantization needs the gated GEMM and groups dividing N={n} and "
                         f"block_n={config.block_n}; got {num_groups} groups")
    return group
