"""Jit helpers: the grouped tile order and the MoE tile matmuls (pointer loads, and TMA loads of the weights)."""
import triton
import triton.language as tl

from tmoe.kernels._details.dequant import b_rows, dequant_dot, oriented_dot


@triton.jit
def tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped (swizzled) order of output tiles: GROUP_M row-blocks share each column sweep."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def moe_tile_matmul(
    a_ptrs,  # [BM, BK] pointers at k = 0
    b_ptrs,  # [BK, BN] pointers at k = 0 (4-bit: [BK/2, BN] packed bytes)
    mask_m,  # [BM] valid rows
    mask_n,  # [BN] valid columns
    a_scale_ptrs,  # [BM] pointers to per-row (or per-row-group) activation scales
    b_scale_ptrs,  # [BN] pointers to per-column (or per-column-group) weight scales
    zp_ptrs,  # [BN] pointers to the columns' zero points (low-bit, HAS_ZP)
    zp_shift,  # [BN] nibble shift of each column's zero point (int4)
    K,
    stride_ak,
    stride_bk,
    stride_ask,
    stride_bsk,
    stride_zpk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_ZP: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    ASM_UNPACK: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    """float32 [BM, BN] = A[rows, :K] @ B[:K, cols], dequantized.

    QUANT: "none"; "scaled" (one scale per row of A and per column of B, broadcast by
    zero strides for per-tensor scales, applied once at the end); "block" (scales per
    GROUP_K slice of K, applied per K tile; GROUP_K is a multiple of BLOCK_K); weight-only
    "int4", "int8", "mxfp4" (B holds codes, 4-bit: [BK/2, BN] packed bytes, two k per byte; one
    scale and zero point per column and GROUP_K slice of K; ``dequant.dequant_dot``).
    SWAP_AB: the K loop accumulates the transposed tile, B^T @ A^T [BN, BM] (B the MMA's LHS, as
    loaded or dequantized), transposed once after the loop.
    """
    offs_k = tl.arange(0, BLOCK_K)
    _, b_k = b_rows(BLOCK_K, QUANT)  # [BK] logical k of B's rows ([BK/2] 4-bit)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(b_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if QUANT == "block":
            k_group = (k * BLOCK_K) // GROUP_K
            a_s = tl.load(a_scale_ptrs + k_group * stride_ask, mask=mask_m, other=0.0)
            b_s = tl.load(b_scale_ptrs + k_group * stride_bsk, mask=mask_n, other=0.0)
            part = oriented_dot(a, b, None, SWAP_AB, PRECISION)  # [BM, BN] ([BN, BM])
            if SWAP_AB:
                acc += part * b_s[:, None] * a_s[None, :]
            else:
                acc += part * a_s[:, None] * b_s[None, :]
        elif QUANT == "none" or QUANT == "scaled":
            acc = oriented_dot(a, b, acc, SWAP_AB, PRECISION)
        else:  # low-bit weights
            acc = dequant_dot(a, b, acc, b_scale_ptrs, zp_ptrs, zp_shift, k * BLOCK_K, K, stride_bsk, stride_zpk,
                              mask_n, BLOCK_K, GROUP_K, QUANT, HAS_ZP, PRECISION, ASM_UNPACK,
                              SWAP_AB)  # [BM, BN] ([BN, BM])
        a_ptrs += BLOCK_K * stride_ak
        if QUANT == "int4" or QUANT == "mxfp4":
            b_ptrs += (BLOCK_K // 2) * stride_bk
        else:
            b_ptrs += BLOCK_K * stride_bk
    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN]
    if QUANT == "scaled":
        a_s = tl.load(a_scale_ptrs, mask=mask_m, other=0.0)
        b_s = tl.load(b_scale_ptrs, mask=mask_n, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    return acc


@triton.jit
def moe_tile_matmul_tma(
    a_src,  # [BM, BK] pointers at k = 0; A_DESC: TMA descriptor of A [EM, K] (expert-sorted rows), block [BM, BK]
    w_desc,  # TMA descriptor of W [E, N_w, K], block [1, BN, BK]; rows or K past the end read zero
    row_0,  # A_DESC: the tile's first row of A
    mask_m,  # [BM] valid rows
    expert,  # int32 expert index of W
    col_0,  # first W row of the first tile
    col_1,  # first W row of the second tile (TWO_TILES)
    n_w,  # rows of W per expert
    a_scale_ptrs,  # [BM] pointers to per-row (or per-row-group) activation scales
    w_scale_ptr,  # this expert's weight scales
    K,
    stride_ak,
    stride_ask,
    stride_wsn,
    stride_wsk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    QUANT: tl.constexpr,
    TWO_TILES: tl.constexpr,
    UNIFORM_W_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    A_DESC: tl.constexpr = False,
    W_KN: tl.constexpr = False,
):
    """float32 ([BM, BN], [BM, BN]) = A[rows, :K] @ W[expert, col:col + BN, :K]^T for col = col_0
    and, TWO_TILES (the gate and up halves of W1), col_1; W is read by TMA, A by pointers or, A_DESC
    (the grouped core: the tile's rows are one expert's run of sorted rows), by TMA too. W_KN (the
    backward's M-grouped GEMMs, A @ W[expert, :K, col:col + BN]): W [E, K, C] read as stored, its
    descriptor's block [1, BK, BN] (``QUANT`` "none").
    Dequantized as moe_tile_matmul; UNIFORM_W_SCALE (block quantization, each tile inside one
    GROUP_N group of W rows) loads one weight scale per tile and K group."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_bn = tl.arange(0, BLOCK_N)
    acc_0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rows_0 = col_0 + offs_bn  # [BN]
    rows_1 = col_1 + offs_bn
    if UNIFORM_W_SCALE:
        ws_0 = w_scale_ptr + (col_0 // GROUP_N) * stride_wsn
        ws_1 = w_scale_ptr + (col_1 // GROUP_N) * stride_wsn
    else:
        ws_0 = w_scale_ptr + (rows_0 // GROUP_N) * stride_wsn  # [BN]
        ws_1 = w_scale_ptr + (rows_1 // GROUP_N) * stride_wsn
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if A_DESC:
            a = a_src.load([row_0, k * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_src, mask=mask_m[:, None], other=0.0)
        else:
            a = tl.load(a_src, mask=mask_m[:, None] & (offs_k[None, :] < K - k * BLOCK_K), other=0.0)
        if W_KN:
            b_0 = w_desc.load([expert, k * BLOCK_K, col_0]).reshape(BLOCK_K, BLOCK_N)  # [BK, BN]
        else:
            b_0 = w_desc.load([expert, col_0, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T  # [BK, BN]
        if TWO_TILES:
            b_1 = w_desc.load([expert, col_1, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
        if QUANT == "block":
            k_group = (k * BLOCK_K) // GROUP_K
            a_s = tl.load(a_scale_ptrs + k_group * stride_ask, mask=mask_m, other=0.0)  # [BM]
            if UNIFORM_W_SCALE:
                acc_0 += tl.dot(a, b_0, input_precision=PRECISION) * (a_s * tl.load(ws_0 + k_group * stride_wsk))[:, None]
                if TWO_TILES:
                    acc_1 += tl.dot(a, b_1, input_precision=PRECISION) * (a_s * tl.load(ws_1 + k_group * stride_wsk))[:, None]
            else:
                s_0 = tl.load(ws_0 + k_group * stride_wsk, mask=rows_0 < n_w, other=0.0)
                acc_0 += tl.dot(a, b_0, input_precision=PRECISION) * a_s[:, None] * s_0[None, :]
                if TWO_TILES:
                    s_1 = tl.load(ws_1 + k_group * stride_wsk, mask=rows_1 < n_w, other=0.0)
                    acc_1 += tl.dot(a, b_1, input_precision=PRECISION) * a_s[:, None] * s_1[None, :]
        else:
            acc_0 = tl.dot(a, b_0, acc_0, input_precision=PRECISION)
            if TWO_TILES:
                acc_1 = tl.dot(a, b_1, acc_1, input_precision=PRECISION)
        if not A_DESC:
            a_src += BLOCK_K * stride_ak
    if QUANT == "scaled":
        a_s = tl.load(a_scale_ptrs, mask=mask_m, other=0.0)
        acc_0 = acc_0 * a_s[:, None] * tl.load(w_scale_ptr + rows_0 * stride_wsn, mask=rows_0 < n_w, other=0.0)[None, :]
        if TWO_TILES:
            acc_1 = acc_1 * a_s[:, None] * tl.load(w_scale_ptr + rows_1 * stride_wsn, mask=rows_1 < n_w, other=0.0)[None, :]
    return acc_0, acc_1

