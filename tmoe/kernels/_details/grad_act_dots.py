"""Jit helpers of ``moe_grad_act``'s K loop: the dots of one program's tile, with the operands
loaded by TMA (aligned-row copies, whole blocks) or gathered by pointers (any strides,
interleaved rows, frozen block-fp8 weights dequantized in registers)."""
import triton
import triton.language as tl

from tmoe.kernels._details.common import dequant_block


@triton.jit
def w1_rows_dot(acc, xt, w1_base, w_rows, offs_k, mask, s1_base, stride_w1r, stride_w1k, stride_s1r, stride_s1c,
                 FP8_W: tl.constexpr, SCALE_R: tl.constexpr, SCALE_C: tl.constexpr, PRECISION: tl.constexpr):
    """acc + xt @ W1[w_rows, offs_k].T: the rows ``w_rows`` [C] of one expert's W1 (``w1_base``)
    loaded by pointers as [BK, C] under ``mask`` (frozen block-fp8: dequantized to xt's dtype with
    the expert's scales at ``s1_base``)."""
    w = tl.load(w1_base + w_rows[None, :] * stride_w1r + offs_k[:, None] * stride_w1k, mask=mask, other=0.0)
    if FP8_W:
        w = dequant_block(w, s1_base, w_rows[None, :], offs_k[:, None], stride_s1r, stride_s1c, mask, SCALE_R,
                          SCALE_C, xt.dtype)
    return tl.dot(xt, w, acc, input_precision=PRECISION)


@triton.jit
def grad_act_dots(
    grad_out_src, x_src, w1_src, w2_src, b2_ptr, s1_ptr, s2_ptr, pid_m, pid_n, expert, tokens, mask_m, offs_n, mask_n,
    gate_rows, up_rows, pair_rows, mask_pair, N, K, stride_gm, stride_gk, stride_xm, stride_xk, stride_w1e,
    stride_w1r, stride_w1k, stride_w2e, stride_w2k, stride_w2n, stride_b2e, stride_s1e, stride_s1r, stride_s1c,
    stride_s2e, stride_s2r, stride_s2c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MUL: tl.constexpr, PAIRED: tl.constexpr, HAS_B2: tl.constexpr, PRECISION: tl.constexpr, FP8_W: tl.constexpr,
    SCALE_R: tl.constexpr, SCALE_C: tl.constexpr, TMA: tl.constexpr, G_FIRST: tl.constexpr, SAVED: tl.constexpr,
    LOAD_GO: tl.constexpr, K_LOOP: tl.constexpr,
):
    """(acc_g [BM, BN], acc_gate [BM, BN], acc_up [BM, BN], acc_pair [BM, 2BN], acc_b2 [BM]) float32 of
    one tile of ``_moe_grad_act_kernel`` (its arguments, same names): go @ w2[e] (unless G_FIRST),
    x @ W1's gate and up rows (unless SAVED; PAIRED: one dot over the contiguous [2BN] rows) and
    <go, b2[e]> (HAS_B2), over the K loop; zeros where nothing runs (not K_LOOP)."""
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_pair = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)  # PAIRED: x @ W1's [2BN] rows
    acc_b2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if K_LOOP:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
            mask_k = offs_k < K
            if TMA:  # aligned rows, whole blocks; rows and columns past the ends read zero
                e32 = expert.to(tl.int32)
                if LOAD_GO:
                    go = grad_out_src.load([(pid_m * BLOCK_M).to(tl.int32), k0])  # [BM, BK]
                if not G_FIRST:
                    w2t = w2_src.load([e32, k0, (pid_n * BLOCK_N).to(tl.int32)]).reshape(BLOCK_K, BLOCK_N)
                    acc_g = tl.dot(go, w2t, acc_g, input_precision=PRECISION)
                if not SAVED:
                    xt = x_src.load([(pid_m * BLOCK_M).to(tl.int32), k0])  # [BM, BK]
                    w1g = w1_src.load([e32, (pid_n * BLOCK_N).to(tl.int32), k0]).reshape(BLOCK_N, BLOCK_K)
                    acc_gate = tl.dot(xt, w1g.T, acc_gate, input_precision=PRECISION)
                    if MUL:
                        w1u = w1_src.load([e32, (N + pid_n * BLOCK_N).to(tl.int32), k0]).reshape(BLOCK_N, BLOCK_K)
                        acc_up = tl.dot(xt, w1u.T, acc_up, input_precision=PRECISION)
            else:  # rows gathered through their tokens, weights by pointers (any strides)
                w1_base = w1_src + expert * stride_w1e
                w2_base = w2_src + expert * stride_w2e + offs_n[None, :] * stride_w2n  # [1, BN]
                mask_a = mask_m[:, None] & mask_k[None, :]
                mask_b = mask_k[:, None] & mask_n[None, :]
                if LOAD_GO:
                    go = tl.load(grad_out_src + tokens[:, None] * stride_gm + offs_k[None, :] * stride_gk, mask=mask_a,
                                 other=0.0)  # [BM, BK]
                if not G_FIRST:
                    w2t = tl.load(w2_base + offs_k[:, None] * stride_w2k, mask=mask_b, other=0.0)  # [BK, BN]
                    if FP8_W:  # frozen block-fp8 weights, dequantized in registers (w2's rows are K, w1's are 2N)
                        w2t = dequant_block(w2t, s2_ptr + expert * stride_s2e, offs_k[:, None], offs_n[None, :],
                                            stride_s2r, stride_s2c, mask_b, SCALE_R, SCALE_C, x_src.dtype.element_ty)
                    acc_g = tl.dot(go, w2t, acc_g, input_precision=PRECISION)
                if not SAVED:
                    xt = tl.load(x_src + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask_a,
                                 other=0.0)  # [BM, BK]
                    s1_base = s1_ptr + expert * stride_s1e
                    if PAIRED:  # [BK, 2BN]
                        acc_pair = w1_rows_dot(acc_pair, xt, w1_base, pair_rows, offs_k,
                                               mask_k[:, None] & mask_pair[None, :], s1_base, stride_w1r, stride_w1k,
                                               stride_s1r, stride_s1c, FP8_W, SCALE_R, SCALE_C, PRECISION)
                    else:
                        acc_gate = w1_rows_dot(acc_gate, xt, w1_base, gate_rows, offs_k, mask_b, s1_base, stride_w1r,
                                               stride_w1k, stride_s1r, stride_s1c, FP8_W, SCALE_R, SCALE_C, PRECISION)
                    if MUL and not PAIRED:
                        acc_up = w1_rows_dot(acc_up, xt, w1_base, up_rows, offs_k, mask_b, s1_base, stride_w1r,
                                             stride_w1k, stride_s1r, stride_s1c, FP8_W, SCALE_R, SCALE_C, PRECISION)
            if HAS_B2:
                b2 = tl.load(b2_ptr + expert * stride_b2e + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BK]
                acc_b2 += tl.sum(go.to(tl.float32) * b2[None, :], axis=1)
    return acc_g, acc_gate, acc_up, acc_pair, acc_b2
