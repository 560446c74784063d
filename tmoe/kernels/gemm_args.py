"""Launch arguments shared by the expert GEMM kernels: fp8 scales, low-bit weight scales and zero
points, and their strides, the shared-memory fit of a tile config, the weights' TMA descriptor, operand
checks, and where a GEMM finds its rows (``Routing``, ``DirectRouting``)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from tmoe.kernels.checks import FLOAT_DTYPES, FP8_DTYPES, check_shape, check_tensor
from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels.common import cdiv
from tmoe.kernels.interpreter import INTERPRETED


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


def _index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device when it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm90(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def asm_unpack(scales: Scales | WeightScales | None, a: torch.Tensor, config: GemmConfig, tile_n: int) -> bool:
    """Whether the kernel unpacks 4-bit codes with PTX (``dequant.packed_values``): bf16/fp16
    activations on an sm_90+ NVIDIA GPU (not the interpreter), and a [block_k / 2, tile_n] code tile
    of at least four bytes per thread (the PTX takes four at a time)."""
    if not isinstance(scales, WeightScales) or scales.weight_dtype == "int8" or a.dtype == torch.float32:
        return False
    if INTERPRETED or a.device.type != "cuda" or (config.block_k // 2) * tile_n < 4 * 32 * config.num_warps:
        return False
    return _sm90(_index(a.device))


def scale_args(
    scales: Scales | WeightScales | None, a: torch.Tensor, w: torch.Tensor, config: GemmConfig, tile_n: int
) -> dict:
    """Launch arguments of the scales (and ``ASM_UNPACK``) of a GEMM whose B tile is
    [block_k, tile_n] weight columns."""
    return {**_scale_args(scales, a, w, config), "ASM_UNPACK": asm_unpack(scales, a, config, tile_n)}


def _scale_args(scales: Scales | WeightScales | None, a: torch.Tensor, w: torch.Tensor, config: GemmConfig) -> dict:
    if isinstance(scales, WeightScales):
        return _weight_scale_args(scales, a, w)
    if scales is None:  # the kernel reads no scale: w stands in for the pointers
        return dict(a_scale_ptr=w, w_scale_ptr=w, stride_ase=0, stride_asm=0, stride_ask=0,
                    stride_wse=0, stride_wsn=0, stride_wsk=0, GROUP_N=1, GROUP_K=1, QUANT="none", **_no_zero_point(w))
    a_s, w_s = scales.a_scale, scales.w_scale
    check_tensor("a_scale", a_s, dtypes=(torch.float32,), device=a.device)
    check_tensor("w_scale", w_s, dtypes=(torch.float32,), device=a.device)
    e, n_w, k = w.shape
    batched = a.dim() == 3
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


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes off a GPU (the interpreter); Hopper's 227 KB minus the margin
EPILOGUE_MARGIN = 27 * 1024  # of a device's per-block limit, left for the epilogue's own shared memory


@functools.cache
def _device_budget(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin - EPILOGUE_MARGIN


def shared_memory_budget(device: torch.device) -> int:
    """Bytes a tile config may stage on ``device``: its opt-in shared memory per block minus
    EPILOGUE_MARGIN (227 KB -> 200 KB on H100/H200, 99 KB -> 72 KB on Ada), read once per
    device index; SHARED_MEMORY_BUDGET off a GPU."""
    if device.type != "cuda":
        return SHARED_MEMORY_BUDGET
    return _device_budget(_index(device))


def codes_per_byte(weight_dtype: str) -> int:
    """Low-bit weight values per byte along K: 2 for the 4-bit schemes (int4, mxfp4), 1 for int8."""
    return 1 if weight_dtype == "int8" else 2


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


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device``, read once per device index."""
    return _sm_count(_index(device))


INTERPRETER_PROGRAMS = 4  # persistent programs under the interpreter: few, so each walks several tiles


def persistent_programs(device: torch.device, num_tiles: int) -> int:
    """Programs of a persistent GEMM of at most ``num_tiles`` tiles: min(SMs, num_tiles), the
    SM count read once per device index; INTERPRETER_PROGRAMS off a GPU."""
    if device.type != "cuda" or INTERPRETED:
        return min(INTERPRETER_PROGRAMS, num_tiles)
    return min(sm_count(device), num_tiles)


def persistent_epilogue_bytes(config: GemmConfig, out_elem_size: int) -> int:
    """Shared memory a persistent config needs beyond EPILOGUE_MARGIN: the [block_m, block_n] output
    tile its epilogue may stage while the tile loop keeps the pipeline buffers live (as measured
    for the flattened loop in the sm_90 compile: +32 KB for a 128 x 128 bf16 tile; kept for the
    plain loop, which was timed with it); 0 for other configs."""
    if not config.persistent:
        return 0
    return max(0, config.block_m * config.block_n * out_elem_size - EPILOGUE_MARGIN)


def weight_descriptor(w: torch.Tensor, config: GemmConfig) -> TensorDescriptor | None:
    """A TMA descriptor of ``w`` (E, N_w, K) with block [1, block_n, block_k] when ``config.tma``
    asks for one (and no ``swap_ab``, a pointer-path option) and TMA can address ``w`` (K contiguous,
    16-byte aligned base and strides); None means pointer loads."""
    size = w.element_size()
    if not config.tma or config.swap_ab or w.stride(2) != 1 or w.data_ptr() % 16 or any(st * size % 16 for st in w.stride()[:2]):
        return None
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [1, config.block_n, config.block_k])


def uniform_w_scale(scales: Scales | None, n: int, block_n: int, gated: bool) -> bool:
    """Block quantization where every [block_n] tile of weight rows (gate and up tiles of W1 start
    at n) lies inside one group: one scale per tile and K group."""
    if scales is None or scales.block_shape is None:
        return False
    gn = scales.block_shape[0]
    return gn % block_n == 0 and (not gated or n % gn == 0)


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
