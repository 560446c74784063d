"""Jit helpers of the weight-only low-bit GEMMs (layouts: ``gemm_args.WeightScales``): the rows of
a K step's B tile, the scales and zero points of a K step, values built from the codes' bits, and
the dequantized dot of one K step.

4-bit B tiles are [BK/2, BN] packed bytes (16-byte loads along K) split into low (even k) and high
(odd k) nibbles, dotted with A's even and odd columns; int8 tiles are [BK, BN]. Values are built
from their bits (no int -> float conversion).

BLOCK_K <= GROUP_K (one group per K step): the group's scale multiplies the step's float32
product. bf16/fp16 steps take int4 codes as OFFSET + q in the activation dtype (OFFSET * rowsum(A)
leaves the float32 product with the zero point) and e2m1 values directly; the other steps (float32
activations, int8) build float32 values from 2^23 + q (q - zp, exact in the activation dtype) or
from the e2m1 bits. BLOCK_K > GROUP_K: the step's groups are loaded once, each value is scaled in
float32, then rounded to the activation dtype for the dot.

SWAP_AB: the same values and scales, each dot taken transposed (``oriented_dot``), so the
accumulator is [BN, BM] and per-column factors of B ([1, BN]) apply as [BN, 1] (``per_column``)."""
import triton
import triton.language as tl


@triton.jit
def weight_k(offs_k, QUANT: tl.constexpr):
    """Offsets along W's last dimension of logical k: k // 2 for the 4-bit schemes (two per byte)."""
    if QUANT == "int4" or QUANT == "mxfp4":
        offs_k = offs_k // 2
    return offs_k


@triton.jit
def b_rows(BLOCK_K: tl.constexpr, QUANT: tl.constexpr):
    """(offsets along W's last dimension, first logical k) of the rows of a K step's B tile: 4-bit:
    BK/2 rows of packed bytes j (k = 2j); else BK rows of logical k."""
    if QUANT == "int4" or QUANT == "mxfp4":
        offs = tl.arange(0, BLOCK_K // 2)
        k = offs * 2
    else:
        k = tl.arange(0, BLOCK_K)
        offs = k
    return offs, k


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
    """(scale float32, zero point int32) of K groups ``k_group`` (a scalar: [1, BN]; [R, 1]:
    [R, BN]) of the tile's columns (``s_ptrs``, ``zp_ptrs``, ``zp_shift`` [1, BN]): mxfp4 scales
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
def code_values(q, QUANT: tl.constexpr, DTYPE: tl.constexpr):
    """int32 codes -> DTYPE (float32, bfloat16, float16) values made from bits alone: int4/int8
    OFFSET + q (OFFSET 2^23, 128, 1024: code_offset; int8 only in float32), mxfp4 the e2m1 value
    of q's low nibble (sign bit 3; e = bits 2-1, m = bit 0: 2^(e-1) (1 + m/2), e = 0: m / 2)."""
    if DTYPE == tl.float32:
        mant, bias, sign, magic = 23, 127, 31, 0x4B000000
    elif DTYPE == tl.bfloat16:
        mant, bias, sign, magic = 7, 127, 15, 0x4300
    else:
        mant, bias, sign, magic = 10, 15, 15, 0x6400
    if QUANT == "mxfp4":
        n = q & 7
        half = (bias - 1) << mant  # 0.5
        bits = tl.where(n > 1, (n << (mant - 1)) + half, (0 - n) & half) | ((q & 8) << (sign - 3))
    else:
        bits = q | magic
    if DTYPE == tl.float32:
        v = bits.to(tl.float32, bitcast=True)
    else:
        v = bits.to(tl.int16).to(DTYPE, bitcast=True)
    return v


@triton.jit
def code_offset(DTYPE: tl.constexpr):
    """The OFFSET of ``code_values``' integer codes in DTYPE."""
    if DTYPE == tl.float32:
        off = 8388608.0
    elif DTYPE == tl.bfloat16:
        off = 128.0
    else:
        off = 1024.0
    return off


@triton.jit
def _step_values(q, zp, s, QUANT: tl.constexpr):
    """float32 (q - zp) * s (int) or e2m1(q) * s (mxfp4) of int32 codes; ``s`` 1.0 for none."""
    v = code_values(q, QUANT, tl.float32)
    if QUANT != "mxfp4":
        v = v - (zp.to(tl.float32) + code_offset(tl.float32))
    return v * s


@triton.jit
def oriented_dot(x, w, acc, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x @ w for x [BM, BK], w [BK, BN]: [BM, BN]; SWAP_AB: acc + w^T @ x^T, [BN, BM] (the
    weights are the MMA's LHS). ``acc`` None: no addend."""
    if SWAP_AB:
        out = tl.dot(tl.trans(w), tl.trans(x), acc, input_precision=PRECISION)  # [BN, BM]
    else:
        out = tl.dot(x, w, acc, input_precision=PRECISION)  # [BM, BN]
    return out


@triton.jit
def per_column(v, SWAP_AB: tl.constexpr):
    """A [1, BN] factor of B's columns shaped for the accumulator: [BN, 1] when SWAP_AB."""
    if SWAP_AB:
        v = tl.trans(v)
    return v


@triton.jit
def _repeat_rows(x, ROWS: tl.constexpr):
    """[NG, BN] -> [ROWS, BN]: row i of x repeated over rows [i * ROWS / NG, (i + 1) * ROWS / NG)."""
    NG: tl.constexpr = x.shape[0]
    BN: tl.constexpr = x.shape[1]
    return tl.reshape(tl.broadcast_to(x[:, None, :], (NG, ROWS // NG, BN)), (ROWS, BN))


@triton.jit
def dequant_dot(a, q, acc, s_ptrs, zp_ptrs, zp_shift, k0, K, stride_sk, stride_zpk, mask_n,
                BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr, QUANT: tl.constexpr, HAS_ZP: tl.constexpr,
                PRECISION: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + a @ dequant(q) in float32 for the K step at ``k0``: a [BM, BK], q [BK/2, BN] packed
    bytes (4-bit) or [BK, BN] (int8), ``s_ptrs``/``zp_ptrs``/``zp_shift``/``mask_n`` [BN] of the
    tile's columns; acc [BM, BN], SWAP_AB: acc [BN, BM] + dequant(q)^T @ a^T."""
    PACKED: tl.constexpr = QUANT == "int4" or QUANT == "mxfp4"
    BLOCK_M: tl.constexpr = a.shape[0]
    q = q.to(tl.int32)
    if PACKED:
        a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))  # [BM, BK/2] each
        lo = q & 0xF  # [BK/2, BN]: k = 2j
        hi = q >> 4  # k = 2j + 1
    if BLOCK_K <= GROUP_K:
        s, zp = group_dequant(s_ptrs[None, :], zp_ptrs[None, :], zp_shift[None, :], k0 // GROUP_K, stride_sk,
                              stride_zpk, mask_n[None, :], QUANT, HAS_ZP)  # [1, BN]
        if PACKED and a.dtype != tl.float32:  # values in a.dtype straight from the bits
            part = oriented_dot(a_even, code_values(lo, QUANT, a.dtype), None, SWAP_AB, PRECISION)
            part = oriented_dot(a_odd, code_values(hi, QUANT, a.dtype), part, SWAP_AB, PRECISION)  # [BM, BN] ([BN, BM])
            if QUANT == "int4":  # the OFFSET of each code: sum_k a_k (OFFSET + zp)
                row_sum = tl.sum(a.to(tl.float32), axis=1)  # [BM]
                offset = per_column(zp.to(tl.float32) + code_offset(a.dtype), SWAP_AB)
                if SWAP_AB:
                    part -= offset * row_sum[None, :]
                else:
                    part -= row_sum[:, None] * offset
        elif PACKED:
            part = oriented_dot(a_even, _step_values(lo, zp, 1.0, QUANT), None, SWAP_AB, PRECISION)
            part = oriented_dot(a_odd, _step_values(hi, zp, 1.0, QUANT), part, SWAP_AB, PRECISION)
        else:
            part = oriented_dot(a, _step_values(q, zp, 1.0, QUANT).to(a.dtype), None, SWAP_AB, PRECISION)
        acc += part * per_column(s, SWAP_AB)
    else:  # the step's NG groups loaded once, each repeated over its rows of q
        NG: tl.constexpr = BLOCK_K // GROUP_K
        ROWS: tl.constexpr = BLOCK_K // 2 if PACKED else BLOCK_K
        g = k0 // GROUP_K + tl.arange(0, NG)  # [NG]
        mask = mask_n[None, :] & (g * GROUP_K < K)[:, None]  # no group past K
        s, zp = group_dequant(s_ptrs[None, :], zp_ptrs[None, :], zp_shift[None, :], g[:, None], stride_sk,
                              stride_zpk, mask, QUANT, HAS_ZP)  # [NG, BN]
        s = _repeat_rows(s, ROWS)  # [ROWS, BN]
        zp = _repeat_rows(zp, ROWS)
        if PACKED:
            acc = oriented_dot(a_even, _step_values(lo, zp, s, QUANT).to(a.dtype), acc, SWAP_AB, PRECISION)
            acc = oriented_dot(a_odd, _step_values(hi, zp, s, QUANT).to(a.dtype), acc, SWAP_AB, PRECISION)
        else:
            acc = oriented_dot(a, _step_values(q, zp, s, QUANT).to(a.dtype), acc, SWAP_AB, PRECISION)
    return acc
