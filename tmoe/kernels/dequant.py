"""Jit helpers of the weight-only low-bit GEMMs (layouts: ``gemm_args.WeightScales``): byte
offsets along K of packed weights, the scales and zero points of a K step, the unpacking of a
[BK, BN] tile of codes into exact float32 values, and the dequantized dot of one K step.

BLOCK_K <= GROUP_K (one group per K step): the codes minus zero points (or e2m1 values) are exact
in the activation dtype and the group's scale multiplies the step's float32 product. BLOCK_K >
GROUP_K: each value is scaled in float32, then rounded to the activation dtype for the dot."""
import triton
import triton.language as tl


@triton.jit
def weight_k(offs_k, QUANT: tl.constexpr):
    """Offsets along W's last dimension of logical k: k // 2 for the 4-bit schemes (two per byte)."""
    if QUANT == "int4" or QUANT == "mxfp4":
        offs_k = offs_k // 2
    return offs_k


@triton.jit
def zero_point_rows(rows, QUANT: tl.constexpr):
    """(offsets along the zero points' row dimension, nibble shift) of W rows: int4 packs two rows
    per byte, the even row in the low nibble."""
    shift = rows * 0
    if QUANT == "int4":
        shift = (rows % 2) * 4
        rows = rows // 2
    return rows, shift


@triton.jit
def group_dequant(s_ptrs, zp_ptrs, zp_shift, k_group, stride_sk, stride_zpk, mask,
                  QUANT: tl.constexpr, HAS_ZP: tl.constexpr):
    """(scale float32, zero point int32) of K groups ``k_group`` (a scalar: [1, BN]; [BK, 1]:
    [BK, BN]) of the tile's columns (``s_ptrs``, ``zp_ptrs``, ``zp_shift`` [1, BN]): mxfp4 scales
    are e8m0 bytes, 2^(s - 127); zero points default to 8 (int4) and 128 (int8)."""
    s = tl.load(s_ptrs + k_group * stride_sk, mask=mask, other=0)
    zp = s.to(tl.int32) * 0
    if QUANT == "mxfp4":
        scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        scale = s.to(tl.float32)
        if HAS_ZP:
            zp = tl.load(zp_ptrs + k_group * stride_zpk, mask=mask, other=0).to(tl.int32)
            if QUANT == "int4":
                zp = (zp >> zp_shift) & 0xF
        elif QUANT == "int4":
            zp += 8
        else:
            zp += 128
    return scale, zp


@triton.jit
def unpack_tile(q, offs_k, zp, QUANT: tl.constexpr):
    """[BK, BN] uint8 codes -> float32 values before the group scale: q - zp (int4/int8, ``zp``
    [1, BN] or [BK, BN]) or the e2m1 value (mxfp4). 4-bit: ``q`` holds bytes; logical k's nibble
    is k % 2, low first."""
    q = q.to(tl.int32)
    if QUANT == "int4" or QUANT == "mxfp4":
        q = (q >> ((offs_k % 2) * 4)[:, None]) & 0xF
    if QUANT == "mxfp4":  # e2m1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0 -> float32 bits
        e = (q >> 1) & 3
        m = q & 1
        bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * 0x3F000000)  # subnormal: 0 or 0.5
        v = (bits | ((q & 8) << 28)).to(tl.float32, bitcast=True)
    else:
        v = (q - zp).to(tl.float32)
    return v


@triton.jit
def dequant_dot(a, q, acc, s_ptrs, zp_ptrs, zp_shift, k0, offs_k, K, stride_sk, stride_zpk, mask_n,
                BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr, QUANT: tl.constexpr, HAS_ZP: tl.constexpr,
                PRECISION: tl.constexpr):
    """acc + a @ dequant(q) in float32 for the K step at ``k0``: a [BM, BK], q [BK, BN] codes,
    ``s_ptrs``/``zp_ptrs``/``zp_shift``/``mask_n`` [BN] of the tile's columns."""
    if BLOCK_K <= GROUP_K:
        s, zp = group_dequant(s_ptrs[None, :], zp_ptrs[None, :], zp_shift[None, :], k0 // GROUP_K, stride_sk,
                              stride_zpk, mask_n[None, :], QUANT, HAS_ZP)  # [1, BN]
        b = unpack_tile(q, offs_k, zp, QUANT).to(a.dtype)  # [BK, BN]
        acc += tl.dot(a, b, input_precision=PRECISION) * s
    else:
        mask = mask_n[None, :] & ((k0 + offs_k) < K)[:, None]  # [BK, BN]: no group past K
        s, zp = group_dequant(s_ptrs[None, :], zp_ptrs[None, :], zp_shift[None, :], ((k0 + offs_k) // GROUP_K)[:, None],
                              stride_sk, stride_zpk, mask, QUANT, HAS_ZP)  # [BK, BN]
        b = (unpack_tile(q, offs_k, zp, QUANT) * s).to(a.dtype)  # [BK, BN]
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc
