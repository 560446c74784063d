"""Jit helpers of the weight-only low-bit GEMMs (layouts: ``operands.WeightScales``): the rows of
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

ASM_UNPACK (an sm_90 GPU, never the interpreter, which cannot run PTX): the bf16/fp16 4-bit steps
build their values with PTX on four packed bytes at a time, each 32-bit operation making two
values (Marlin's trick): ``prmt`` spreads two bytes into the 16-bit lanes, one ``lop3`` makes
OFFSET + q (int4), and e2m1 is placed into the lanes as a subnormal-aware 16-bit pattern times an
exact power of two (bf16: e2m1 * 2^-126, times 2^126; fp16: e2m1 * 2^-14, times 2^14). About one
instruction per int4 value and three per e2m1 value instead of four and eleven. Steps over several
groups scale in the PTX too (bf16 mxfp4: times the e8m0 scale; int4 with scales in the activation
dtype: minus OFFSET + zp, exact, then times the scale, rounded once as the int32 path rounds).

SWAP_AB: the same values and scales, each dot taken transposed (``oriented_dot``), so the
accumulator is [BN, BM] and per-column factors of B ([1, BN]) apply as [BN, 1] (``per_column``)."""
import triton
import triton.language as tl


def _unpack_asm(quant: str, dtype: str, scaled: bool = False) -> str:
    """PTX of ``packed_values`` for pack=4: $4 holds bytes b0..b3; $0/$1 the low-nibble values of
    (b0, b1)/(b2, b3), $2/$3 the high-nibble ones, first element in the low 16 bits. ``scaled``:
    each pair times its scales, $5 (b0, b1) and $6 (b2, b3) (e2m1: bf16 only); int4 first minus its
    OFFSET + zero point pairs, $7 and $8, so the values are (q - zp) * s, rounded once."""
    mul, sub = ("mul.rn.bf16x2", "sub.rn.bf16x2") if dtype == "bf16" else ("mul.rn.f16x2", "sub.rn.f16x2")
    lines = ["{", ".reg .b32 t0, t1, z, v, s, c, s01, s23, z01, z23;", "mov.b32 z, 0;",
             *(["mov.b32 s01, $5;", "mov.b32 s23, $6;"] if scaled else []),  # read before any output is written
             *(["mov.b32 z01, $7;", "mov.b32 z23, $8;"] if scaled and quant == "int4" else []),
             "prmt.b32 t0, $4, z, 0x4140;", "prmt.b32 t1, $4, z, 0x4342;"]  # bytes (b0, 0, b1, 0), (b2, 0, b3, 0)
    if quant == "int4":
        lines.append(f"mov.b32 c, {'0x43004300' if dtype == 'bf16' else '0x64006400'};")  # 128.0 / 1024.0
        for out, src, shift in (("$0", "t0", 0), ("$1", "t1", 0), ("$2", "t0", 4), ("$3", "t1", 4)):
            if shift:
                lines.append(f"shr.b32 {src}, {src}, {shift};")
            lines.append(f"lop3.b32 {out}, {src}, 0x000F000F, c, 0xEA;")  # (src & mask) | c
            if scaled:  # OFFSET + q - (OFFSET + zp) is exact; the product is rounded once
                pair = "01" if src == "t0" else "23"
                lines += [f"{sub} {out}, {out}, z{pair};", f"{mul} {out}, {out}, s{pair};"]
    else:  # e2m1: magnitude bits 2-0 to the 16-bit lane's low exponent and top mantissa bits, sign bit 3 to 15
        mag_shift, mask, scale = (6, "0x01C001C0", "0x7E807E80") if dtype == "bf16" else (9, "0x0E000E00", "0x74007400")
        lines.append(f"mov.b32 c, {scale};")  # 2^126 (bf16) or 2^14 (fp16) in both lanes
        for out, src, nibble in (("$0", "t0", 0), ("$1", "t1", 0), ("$2", "t0", 4), ("$3", "t1", 4)):
            lines += [f"shl.b32 v, {src}, {mag_shift - nibble};", f"shl.b32 s, {src}, {12 - nibble};",
                      f"and.b32 v, v, {mask};", "lop3.b32 v, s, 0x80008000, v, 0xEA;", f"{mul} {out}, v, c;"]
            if scaled:
                lines.append(f"{mul} {out}, {out}, {'s01' if src == 't0' else 's23'};")
    return "\n".join(lines + ["}"])


_INT4_BF16 = tl.constexpr(_unpack_asm("int4", "bf16"))
_INT4_FP16 = tl.constexpr(_unpack_asm("int4", "fp16"))
_MXFP4_BF16 = tl.constexpr(_unpack_asm("mxfp4", "bf16"))
_MXFP4_FP16 = tl.constexpr(_unpack_asm("mxfp4", "fp16"))
_MXFP4_BF16_SCALED = tl.constexpr(_unpack_asm("mxfp4", "bf16", scaled=True))
_INT4_BF16_SCALED = tl.constexpr(_unpack_asm("int4", "bf16", scaled=True))
_INT4_FP16_SCALED = tl.constexpr(_unpack_asm("int4", "fp16", scaled=True))


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
def packed_values(q, QUANT: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """(low-nibble, high-nibble) DTYPE values (``code_values``; bfloat16 or float16) of packed
    4-bit codes q [R, C] uint8: ASM with PTX four bytes at a time, else with int32 operations."""
    if ASM and DTYPE == tl.bfloat16:
        lo, hi = tl.inline_asm_elementwise(_INT4_BF16 if QUANT == "int4" else _MXFP4_BF16, "=r,=r,=r,=r,r", [q],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    elif ASM:
        lo, hi = tl.inline_asm_elementwise(_INT4_FP16 if QUANT == "int4" else _MXFP4_FP16, "=r,=r,=r,=r,r", [q],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        q = q.to(tl.int32)
        lo = code_values(q & 0xF, QUANT, DTYPE)
        hi = code_values(q >> 4, QUANT, DTYPE)
    return lo, hi


@triton.jit
def scaled_e2m1_values(q, s):
    """(low-nibble, high-nibble) bfloat16 values e2m1 * s of packed e2m1 codes q [R, C] uint8,
    s [R, C] bfloat16 powers of two (exact), by PTX (sm_90)."""
    return tl.inline_asm_elementwise(_MXFP4_BF16_SCALED, "=r,=r,=r,=r,r,r,r", [q, s],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def scaled_int4_values(q, s, zp):
    """(low-nibble, high-nibble) values (q - zp) * s in s's dtype (bfloat16 or float16) of packed
    int4 codes q [R, C] uint8; s [R, C] the scales, zp [R, C] OFFSET + zero point (``code_offset``),
    both in that dtype, by PTX (sm_90): bit-identical to float32 (q - zp) * s rounded to it."""
    if s.dtype == tl.bfloat16:
        lo, hi = tl.inline_asm_elementwise(_INT4_BF16_SCALED, "=r,=r,=r,=r,r,r,r,r,r", [q, s, zp],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(_INT4_FP16_SCALED, "=r,=r,=r,=r,r,r,r,r,r", [q, s, zp],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return lo, hi


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
                PRECISION: tl.constexpr, ASM_UNPACK: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + a @ dequant(q) in float32 for the K step at ``k0``: a [BM, BK], q [BK/2, BN] packed
    bytes (4-bit) or [BK, BN] (int8), uint8; ``s_ptrs``/``zp_ptrs``/``zp_shift``/``mask_n`` [BN] of
    the tile's columns; acc [BM, BN], SWAP_AB: acc [BN, BM] + dequant(q)^T @ a^T; ASM_UNPACK:
    ``packed_values`` by PTX (bf16/fp16 4-bit steps)."""
    PACKED: tl.constexpr = QUANT == "int4" or QUANT == "mxfp4"
    BLOCK_M: tl.constexpr = a.shape[0]
    if PACKED:
        a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))  # [BM, BK/2] each
    if BLOCK_K <= GROUP_K:
        s, zp = group_dequant(s_ptrs[None, :], zp_ptrs[None, :], zp_shift[None, :], k0 // GROUP_K, stride_sk,
                              stride_zpk, mask_n[None, :], QUANT, HAS_ZP)  # [1, BN]
        if PACKED and a.dtype != tl.float32:  # values in a.dtype straight from the bits
            lo, hi = packed_values(q, QUANT, a.dtype, ASM_UNPACK)  # [BK/2, BN]: k = 2j, 2j + 1
            part = oriented_dot(a_even, lo, None, SWAP_AB, PRECISION)
            part = oriented_dot(a_odd, hi, part, SWAP_AB, PRECISION)  # [BM, BN] ([BN, BM])
            if QUANT == "int4":  # the OFFSET of each code: sum_k a_k (OFFSET + zp)
                row_sum = tl.sum(a.to(tl.float32), axis=1)  # [BM]
                offset = per_column(zp.to(tl.float32) + code_offset(a.dtype), SWAP_AB)
                if SWAP_AB:
                    part -= offset * row_sum[None, :]
                else:
                    part -= row_sum[:, None] * offset
        elif PACKED:
            q = q.to(tl.int32)
            part = oriented_dot(a_even, _step_values(q & 0xF, zp, 1.0, QUANT), None, SWAP_AB, PRECISION)
            part = oriented_dot(a_odd, _step_values(q >> 4, zp, 1.0, QUANT), part, SWAP_AB, PRECISION)
        else:
            part = oriented_dot(a, _step_values(q.to(tl.int32), zp, 1.0, QUANT).to(a.dtype), None, SWAP_AB,
                                PRECISION)
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
        if PACKED:  # (low-nibble, high-nibble) values [BK/2, BN], scaled, in a.dtype
            if ASM_UNPACK and QUANT == "mxfp4" and a.dtype == tl.bfloat16:  # powers of two: exact in bf16
                lo, hi = scaled_e2m1_values(q, s.to(tl.bfloat16))
            elif ASM_UNPACK and QUANT == "int4" and s_ptrs.dtype.element_ty == a.dtype:  # scales exact in a.dtype
                lo, hi = scaled_int4_values(q, s.to(a.dtype), (zp.to(tl.float32) + code_offset(a.dtype)).to(a.dtype))
            else:
                q = q.to(tl.int32)
                lo = _step_values(q & 0xF, zp, s, QUANT).to(a.dtype)
                hi = _step_values(q >> 4, zp, s, QUANT).to(a.dtype)
            acc = oriented_dot(a_even, lo, acc, SWAP_AB, PRECISION)
            acc = oriented_dot(a_odd, hi, acc, SWAP_AB, PRECISION)
        else:
            acc = oriented_dot(a, _step_values(q.to(tl.int32), zp, s, QUANT).to(a.dtype), acc, SWAP_AB, PRECISION)
    return acc
