"""Jit helpers of the weight-only low-bit GEMMs (layouts: ``gemm_args.WeightScales``): byte
offsets along K of packed weights, one K group's scales and zero points, and the unpacking of a
[BK, BN] tile of codes into exact values in the activation dtype. The group scale is applied to
the float32 product of each K step (BLOCK_K divides the group size: one group per step)."""
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
def group_dequant(s_ptrs, zp_ptrs, zp_shift, k_group, stride_sk, stride_zpk, mask_n,
                  QUANT: tl.constexpr, HAS_ZP: tl.constexpr):
    """(scale float32 [BN], zero point int32 [BN]) of K group ``k_group`` for the tile's columns:
    mxfp4 scales are e8m0 bytes, 2^(s - 127); zero points default to 8 (int4) and 128 (int8)."""
    s = tl.load(s_ptrs + k_group * stride_sk, mask=mask_n, other=0)  # [BN]
    zp = s.to(tl.int32) * 0
    if QUANT == "mxfp4":
        scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        scale = s.to(tl.float32)
        if HAS_ZP:
            zp = tl.load(zp_ptrs + k_group * stride_zpk, mask=mask_n, other=0).to(tl.int32)
            if QUANT == "int4":
                zp = (zp >> zp_shift) & 0xF
        elif QUANT == "int4":
            zp += 8
        else:
            zp += 128
    return scale, zp


@triton.jit
def unpack_tile(q, offs_k, zp, QUANT: tl.constexpr, DTYPE: tl.constexpr):
    """[BK, BN] uint8 codes -> values before the group scale, exact in DTYPE: q - zp (int4/int8)
    or the e2m1 value (mxfp4). 4-bit: ``q`` holds bytes; logical k's nibble is k % 2, low first."""
    q = q.to(tl.int32)
    if QUANT == "int4" or QUANT == "mxfp4":
        q = (q >> ((offs_k % 2) * 4)[:, None]) & 0xF
    if QUANT == "mxfp4":  # e2m1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0 -> float32 bits
        e = (q >> 1) & 3
        m = q & 1
        bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * 0x3F000000)  # subnormal: 0 or 0.5
        v = (bits | ((q & 8) << 28)).to(tl.float32, bitcast=True)
    else:
        v = (q - zp[None, :]).to(tl.float32)
    return v.to(DTYPE)
