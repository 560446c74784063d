"""The expert GEMMs' epilogue: routed weight, bias, activation, fused fp8 output quantization, store.

One jit helper, called once per output tile by ``moe_gemm._moe_gemm_kernel`` (once per program,
or per tile of a persistent program's loop)."""
import torch
import triton
import triton.language as tl

from tmoe.kernels._details.common import abs_no_nan, act_and_mul, act_no_mul, fp8_scale, to_fp8
from tmoe.kernels._details.lora_dot import lora_term, lora_term_adapters

FP8_MAX = tl.constexpr(torch.finfo(torch.float8_e4m3fn).max)  # 448.0


@triton.jit
def moe_epilogue(
    acc,  # [BM, BN] float32: gate (MUL), h (up GEMM without MUL) or the down GEMM's tile
    up,  # [BM, BN] float32: the up half of a MUL tile (unused otherwise)
    out_ptrs,  # [BM, BN] pointers into the output
    mask_m,  # [BM] valid rows
    mask_n,  # [BN] valid columns
    offs_n,  # [BN] int64 output columns
    slots,  # [BM] int64 slot of each row (MUL_ROUTED_WEIGHT)
    bias_ptrs,  # [BN] this expert's gate (or only) biases of the tile's columns (HAS_BIAS)
    topk_weights_ptr,  # [num_slots] float32
    out_scale_ptrs,  # [BM] pointers to each row's first output scale (QUANT_OUT)
    pre_ptrs,  # [BM] pointers to each row of the saved pre-activation, gate columns then up (SAVE_PRE)
    pid_n, N, stride_osg, quant_eps, act_alpha, act_limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, MUL: tl.constexpr,
    INTERLEAVED: tl.constexpr, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, QUANT_OUT: tl.constexpr, GROUP_OUT: tl.constexpr, SAVE_PRE: tl.constexpr,
    lora_u_rows,  # [BM] pointers to each row's t = x @ A[e].T (LORA), row = slot
    lora_b_ptr,  # this expert's B[e] (W's rows, rank) (LORA)
    lora_rank, stride_lbn, stride_lbr, lora_scale,
    lora_adapter_rows,  # [BM] pointers to each row's adapter index, int32, -1 for none (LORA_ADAPTERS)
    lora_num_adapters, stride_lbl,  # LORA_ADAPTERS: the stacked adapters' count and B's adapter stride
    LORA: tl.constexpr, LORA_R: tl.constexpr, LORA_ADAPTERS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Up GEMM (GATED): store act((w * x) @ W1 + b1) (the weight scales the input, not the bias),
    QUANT_OUT as fp8 codes and one scale per 1 x GROUP_OUT group (``per_token_group_quant_fp8``);
    SAVE_PRE: also store x @ W1 (before the weight and the bias) in the saved tensor's dtype (gate
    columns, then up columns at + N, whatever W1's row order), which training's backward reads;
    down GEMM: store w * (h @ W2 + b2). Up biases sit at + N (INTERLEAVED: + 1). LORA: x @ W
    becomes x @ W + lora_scale * t @ B[e].T first (``lora_dot``; gate and up rows of B in W1's row
    order), which SAVE_PRE saves as the pre-activation. LORA_ADAPTERS: B is one of several stacked
    adapters, each row's its own (``lora_term_adapters``)."""
    if LORA:
        if GATED and MUL:
            gate_rows = offs_n * (1 + INTERLEAVED)  # [BN] rows of W1 (and B1)
            up_rows = gate_rows + (1 if INTERLEAVED else N)
        else:
            gate_rows = offs_n
            up_rows = offs_n
        if LORA_ADAPTERS:
            adapters = tl.load(lora_adapter_rows, mask=mask_m, other=-1)  # [BM]
            acc = lora_term_adapters(acc, lora_u_rows, adapters, mask_m, lora_b_ptr, gate_rows, mask_n, lora_rank,
                                     lora_num_adapters, stride_lbl, stride_lbr, stride_lbn, lora_scale, LORA_R,
                                     PRECISION)
            if GATED and MUL:
                up = lora_term_adapters(up, lora_u_rows, adapters, mask_m, lora_b_ptr, up_rows, mask_n, lora_rank,
                                        lora_num_adapters, stride_lbl, stride_lbr, stride_lbn, lora_scale, LORA_R,
                                        PRECISION)
        else:
            acc = lora_term(acc, lora_u_rows, mask_m, lora_b_ptr, gate_rows, mask_n, lora_rank, stride_lbr,
                            stride_lbn, lora_scale, LORA_R, PRECISION)
            if GATED and MUL:
                up = lora_term(up, lora_u_rows, mask_m, lora_b_ptr, up_rows, mask_n, lora_rank, stride_lbr,
                               stride_lbn, lora_scale, LORA_R, PRECISION)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + slots, mask=mask_m, other=0.0)  # [BM]
    if GATED:
        if SAVE_PRE:  # x @ W1 of the tile, before the router weight and the bias
            pre = pre_ptrs[:, None] + offs_n[None, :]  # [BM, BN]
            mask_pre = mask_m[:, None] & mask_n[None, :]
            tl.store(pre, acc.to(pre_ptrs.dtype.element_ty), mask=mask_pre)
            if MUL:
                tl.store(pre + N, up.to(pre_ptrs.dtype.element_ty), mask=mask_pre)
        if MUL_ROUTED_WEIGHT:
            acc = acc * weight[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if MUL:
            if MUL_ROUTED_WEIGHT:
                up = up * weight[:, None]
            if HAS_BIAS:
                up_bias_offset = 1 if INTERLEAVED else N
                up += tl.load(bias_ptrs + up_bias_offset, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if MUL:
            acc = act_and_mul(acc, up, act_alpha, act_limit, ACTIVATION, CLAMP)
        else:
            acc = act_no_mul(acc, ACTIVATION)
        if QUANT_OUT:
            NUM_G: tl.constexpr = BLOCK_N // GROUP_OUT
            acc = tl.where(mask_n[None, :], acc, 0.0)
            groups = tl.reshape(acc, (BLOCK_M, NUM_G, GROUP_OUT))  # [BM, G, GROUP_OUT]
            scale = fp8_scale(tl.max(abs_no_nan(groups), axis=2), quant_eps, FP8_MAX, False)  # [BM, G]
            q = to_fp8(groups, tl.broadcast_to(scale[:, :, None], (BLOCK_M, NUM_G, GROUP_OUT)), FP8_MAX)
            acc = tl.reshape(q, (BLOCK_M, BLOCK_N))
            offs_g = pid_n.to(tl.int64) * NUM_G + tl.arange(0, NUM_G)  # [G]
            scale_ptrs = out_scale_ptrs[:, None] + offs_g[None, :] * stride_osg  # [BM, G]
            tl.store(scale_ptrs, scale, mask=mask_m[:, None] & (offs_g * GROUP_OUT < N)[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if MUL_ROUTED_WEIGHT:
            acc = acc * weight[:, None]
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
