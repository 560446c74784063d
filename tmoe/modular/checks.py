"""Checks of a layer call that raise before any launch, naming the argument. Plain Python on
shapes, dtypes and devices, so the same function serves the eager op and its fake (on fake
tensors a dimension check becomes an equality guard, never a data-dependent branch)."""
from __future__ import annotations

import torch

from tmoe.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_shape, check_tensor
from tmoe.kernels.common import ACTIVATIONS, cdiv
from tmoe.modular.call import LayerArgs
from tmoe.modular.quant_config import FusedMoEQuantConfig

_TENSORS = ("expert_map", "w1_scale", "w2_scale", "a1_scale", "a2_scale", "w1_bias", "w2_bias", "w1_zp", "w2_zp")


def check_low_bit_weights(args: LayerArgs, quant: FusedMoEQuantConfig) -> tuple[int, int]:
    """Weight-only int4/int8/mxfp4 (layouts: ``tmoe.kernels.gemm_args.WeightScales``): w1 uint8
    (E, 2N, K / p), w2 uint8 (E, K, N / p), p = 2 for the 4-bit schemes; scales (E, rows,
    cdiv(K_in, g)), float (e8m0 uint8 for mxfp4); zero points uint8 (E, rows / p, cdiv(K_in, g)).
    Returns (E, 2N)."""
    x, wd, g = args.hidden_states, quant.weight_dtype, quant.group_size
    k = x.shape[1]
    pack = 1 if wd == "int8" else 2
    for name in ("w1", "w2"):
        check_tensor(name, getattr(args, name), dtypes=(torch.uint8,), ndim=3, device=x.device)
    e, two_n = args.w1.shape[0], args.w1.shape[1]
    n = two_n // 2
    if two_n % 2:
        raise ValueError(f"w1 must be (E, 2N, K) with gate rows then up rows; got {two_n} rows")
    if pack == 2 and (k % 2 or n % 2):
        raise ValueError(f"{wd} packs two values per byte along K: the hidden size K={k} and the intermediate "
                         f"size N={n} must be even")
    for name, shape in (("w1", (e, two_n, k // pack)), ("w2", (e, k, n // pack))):
        w = getattr(args, name)
        if tuple(w.shape) != shape:
            raise ValueError(f"{name} must be {wd} codes of shape {shape} (packed {pack} per byte along its last "
                             f"dimension) for hidden_states (M, K={k}); got {tuple(w.shape)}")
    if args.a1_scale is not None or args.a2_scale is not None:
        raise ValueError(f"a1_scale/a2_scale are fp8 activation scales; {wd} weights keep activations unquantized")
    for name, rows, cols in (("w1", two_n, k), ("w2", k, n)):
        scale, zp = getattr(args, f"{name}_scale"), getattr(args, f"{name}_zp")
        if scale is None:
            raise ValueError(f"{wd} experts need {name}_scale")
        check_tensor(f"{name}_scale", scale, dtypes=(torch.uint8,) if wd == "mxfp4" else FLOAT_DTYPES, ndim=3)
        check_shape(f"{name}_scale", scale, (e, rows, cdiv(cols, g)))
        if zp is not None:
            if wd == "mxfp4":
                raise ValueError(f"mxfp4 weights have no zero points; got {name}_zp")
            check_tensor(f"{name}_zp", zp, dtypes=(torch.uint8,), ndim=3)
            check_shape(f"{name}_zp", zp, (e, rows // pack, cdiv(cols, g)))
    return e, two_n


def check_layer_call(args: LayerArgs, quant: FusedMoEQuantConfig) -> None:
    """Shape, dtype and device checks of one layer call. ``quant``'s dtype is the weights' (None:
    w1/w2 have hidden_states' dtype; fp8: w1/w2 fp8 with their scales; ``weight_dtype``: low-bit codes)."""
    x = args.hidden_states
    check_tensor("hidden_states", x, dtypes=FLOAT_DTYPES, ndim=2)
    dev = x.device
    for name in _TENSORS:
        t = getattr(args, name)
        if t is not None:
            check_tensor(name, t, device=dev)
    m, k = x.shape
    if quant.weight_dtype is not None:
        e, two_n = check_low_bit_weights(args, quant)
    else:
        e, two_n = _check_weights(args, quant)
    check_tensor("topk_ids", args.topk_ids, dtypes=INDEX_DTYPES, ndim=2, device=dev, contiguous=True)
    check_tensor("topk_weights", args.topk_weights, dtypes=(torch.float32,), ndim=2, device=dev, contiguous=True)
    if args.topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids must be (M={m}, topk) like hidden_states; got shape {tuple(args.topk_ids.shape)}")
    check_shape("topk_weights", args.topk_weights, tuple(args.topk_ids.shape))
    if args.activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {args.activation!r}")
    if args.apply_router_weight_on_input and args.topk_ids.shape[1] != 1:
        raise ValueError("apply_router_weight_on_input needs topk == 1")
    for name, rows in (("w1_bias", two_n), ("w2_bias", k)):
        bias = getattr(args, name)
        if bias is not None:
            check_tensor(name, bias, dtypes=FLOAT_DTYPES, ndim=2)
            check_shape(name, bias, (e, rows))
            if bias.stride(1) != 1:
                raise ValueError(f"{name} must be contiguous along its last dimension")
    num_experts = args.global_num_experts if args.global_num_experts > 0 else e
    if args.expert_map is not None:
        check_tensor("expert_map", args.expert_map, dtypes=(torch.int32,), ndim=1, contiguous=True)
        check_shape("expert_map", args.expert_map, (num_experts,))
    elif num_experts != e:
        raise ValueError(f"global_num_experts={num_experts} differs from w1's {e} experts but no expert_map given")
    if quant.scheme == "block":
        bk = quant.block_shape[1]
        if k % bk or (two_n // 2) % bk:
            raise ValueError(f"block_shape[1]={bk} (the activation group size) must divide the hidden size K={k} "
                             f"and the intermediate size N={two_n // 2}")


def _check_weights(args: LayerArgs, quant: FusedMoEQuantConfig) -> tuple[int, int]:
    """w1 (E, 2N, K), w2 (E, K, N) in hidden_states' dtype, or fp8 with their scales; returns (E, 2N)."""
    x, w1, w2 = args.hidden_states, args.w1, args.w2
    weight_dtype = quant.quant_dtype or x.dtype
    why = "the quant config's dtype" if quant.quant_dtype else "hidden_states' dtype; pass a quant_config for fp8 weights"
    for name, w, scale_name in (("w1", w1, "w1_scale"), ("w2", w2, "w2_scale")):
        check_tensor(name, w, ndim=3, device=x.device)
        if w.dtype != weight_dtype:
            raise TypeError(f"{name} has dtype {w.dtype}, expected {weight_dtype} ({why})")
        if quant.quant_dtype is not None and getattr(args, scale_name) is None:
            raise ValueError(f"fp8 experts need {scale_name}")
    if args.w1_zp is not None or args.w2_zp is not None:
        raise ValueError("w1_zp/w2_zp are zero points of int4/int8 weights; pass "
                         "quant_config=FusedMoEQuantConfig(weight_dtype='int4' or 'int8', group_size=g)")
    k = x.shape[1]
    e, two_n, k1 = w1.shape
    if two_n % 2:
        raise ValueError(f"w1 must be (E, 2N, K) with gate rows then up rows; got {two_n} rows")
    if k1 != k:
        raise ValueError(f"w1 must be (E, 2N, K={k}) to match hidden_states (M, K={k}); got shape {tuple(w1.shape)}")
    check_shape("w2", w2, (e, k, two_n // 2))
    return e, two_n


def check_static_scales(args: LayerArgs) -> None:
    """Reject a zero, negative or non-finite static activation scale held in host memory. A scale
    on a GPU is not read (that would sync the host): there such a scale gives inf/NaN codes."""
    for name in ("a1_scale", "a2_scale"):
        scale = getattr(args, name)
        if scale is not None and scale.device.type == "cpu":
            check_tensor(name, scale, dtypes=(torch.float32,))
            if scale.numel() != 1:
                raise ValueError(f"{name} must hold one element (a static per-tensor scale), got shape "
                                 f"{tuple(scale.shape)}")
            if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
                raise ValueError(f"{name} must be a positive finite scale, got {scale.reshape(-1).tolist()}")


def check_no_grad_inplace(hidden_states: torch.Tensor) -> None:
    """In-place on a tensor that requires grad breaks autograd (torch's in-place ops refuse it)."""
    if hidden_states.requires_grad:
        raise RuntimeError("inplace=True on hidden_states that requires grad: tmoe's layer is inference-only and "
                           "an in-place write would break autograd; pass inplace=False or run under torch.no_grad()")


def check_no_overlap(hidden_states: torch.Tensor) -> None:
    """In-place into a tensor whose elements overlap in memory (expanded, stride 0) writes one
    element for several rows (torch's in-place ops refuse it)."""
    if hidden_states.numel() > 1 and torch._debug_has_internal_overlap(hidden_states) == 1:
        raise RuntimeError("inplace=True on hidden_states whose elements overlap in memory (an expanded tensor); "
                           "clone it first, as torch's in-place ops require")
