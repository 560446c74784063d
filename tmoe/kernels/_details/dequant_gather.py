"""Jit helper of the backward's GEMMs over frozen low-bit weights (layouts: ``operands.WeightScales``):
a tile of W gathered element by element with its groups' scales and zero points, where the packed
dimension (k) may be the tile's output dimension (dX's K over w1, g's N over w2), unlike the
forward's K steps (``dequant.dequant_dot``), which unpack whole bytes along the dot's K."""
import triton
import triton.language as tl

from tmoe.kernels._details.dequant import _step_values, group_dequant


@triton.jit
def dequant_gather(w_base, rows, cols, mask, stride_wr, stride_wc, s_base, stride_sr, stride_sc, zp_base, stride_zr,
                   stride_zc, GROUP: tl.constexpr, QUANT: tl.constexpr, HAS_ZP: tl.constexpr, DTYPE: tl.constexpr):
    """W[rows, cols] in DTYPE of one expert's low-bit W (``w_base``; rows and cols broadcastable
    int64 index blocks, cols the logical k, the packed dimension: byte k // 2, even k in the low
    nibble for 4-bit), each element gathered with its group's scale and zero point: float32 (q - zp)
    * s (int4, int8) or e2m1(q) * 2^(s - 127) (mxfp4), rounded to DTYPE. The backward's tiles,
    whose packed dimension may be the output's (dX's K, g's N) rather than the dot's."""
    if QUANT == "int4" or QUANT == "mxfp4":
        byte = tl.load(w_base + rows * stride_wr + (cols // 2) * stride_wc, mask=mask, other=0).to(tl.int32)
        q = (byte >> ((cols % 2) * 4).to(tl.int32)) & 0xF
    else:
        q = tl.load(w_base + rows * stride_wr + cols * stride_wc, mask=mask, other=0).to(tl.int32)
    group = cols // GROUP
    if QUANT == "int4":
        zp_rows, zp_shift = rows // 2, ((rows % 2) * 4).to(tl.int32)
    else:
        zp_rows, zp_shift = rows, 0
    s, zp = group_dequant(s_base + rows * stride_sr, zp_base + zp_rows * stride_zr, zp_shift, group, stride_sc,
                          stride_zc, mask, QUANT, HAS_ZP)
    return _step_values(q, zp, s, QUANT).to(DTYPE)
