"""Down GEMM fused with the weighted top-k reduce, for decode (no align stage, no per-slot output):
out[m] = sum_t w[m, t] * (h[m * topk + t] @ w2[e_t].T + b2[e_t]).

One program per (token, block of output columns) loads the token's experts and weights once,
then runs a single K loop over all of its slots (slot t, then its K tiles), so the pipeline
never drains between experts. Row 0 of the [16, BN] tile is the token; the other rows are masked (the tensor cores take 16 rows). Slots of
out-of-range or remote experts are never read and contribute exactly zero. All offsets int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels._details.common import local_expert
from tmoe.kernels.sizes import cdiv, next_power_of_2
from tmoe.kernels._details.dequant import b_rows, dequant_dot, weight_k, zero_point_rows
from tmoe.kernels.gemm_args import fit_shared_memory, fit_low_bit, scale_args, weight_bytes
from tmoe.kernels.operands import Scales, WeightScales
from tmoe.runtime.device import shared_memory_budget
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from tmoe.runtime.plan import Launch, planned


@triton.jit
def _slot_of(experts_t, weights_t, offs_t, t):
    """Slot t's (expert, weight) picked out of the token's [TOPK_P2] register vectors."""
    return tl.sum(tl.where(offs_t == t, experts_t, 0)), tl.sum(tl.where(offs_t == t, weights_t, 0.0))


@triton.jit(do_not_specialize=['num_tokens'])
def _moe_down_reduce_kernel(
    a_ptr,  # [num_tokens * TOPK, K] per-slot intermediate, float or fp8
    w_ptr,  # [E, N, K]
    out_ptr,  # [num_tokens, N]
    a_scale_ptr,  # block: [slots, K // GROUP_K]; scaled: [slots] or 1 element (zero stride)
    w_scale_ptr,  # block: [E, N // GROUP_N, K // GROUP_K]; scaled: [E] or [E, N]
    topk_weights_ptr,  # [num_tokens, TOPK] float32, contiguous (APPLY_WEIGHTS)
    topk_ids_ptr,  # [num_tokens, TOPK] int32/int64, contiguous
    expert_map_ptr,  # [num_experts] int32 (HAS_MAP)
    bias_ptr,  # [E, N] (HAS_BIAS)
    w_zp_ptr,  # HAS_ZP: low-bit zero points, int4 [E, N // 2, K // GROUP_K], int8 [E, N, K // GROUP_K]
    N, K, num_tokens, num_experts, num_local_experts,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_be, stride_zpe, stride_zpn, stride_zpk,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr, APPLY_WEIGHTS: tl.constexpr, HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, HAS_ZP: tl.constexpr, ASM_UNPACK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    pdl_wait(USE_PDL)  # PDL: before anything is read; the next kernel may start after the slot loop (pdl.py)
    # the tokens of one column block run side by side: experts they share stay in L2
    pid_m = (pid % num_tokens).to(tl.int64)
    pid_n = (pid // num_tokens).to(tl.int64)
    offs_bm = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    row0 = offs_bm[:, None] == 0  # [BM, 1]
    zp_rows, zp_shift = zero_point_rows(offs_n, QUANT)  # [BN] (low-bit weights)
    offs_wk, b_k = b_rows(BLOCK_K, QUANT)  # [BK] ([BK/2] 4-bit: packed bytes)
    # the token's experts and weights, loaded once: addresses in the loop depend only on
    # registers and the loop index, so the pipeliner can prefetch across slot boundaries
    offs_t = tl.arange(0, TOPK_P2)
    slots_t = pid_m * TOPK + offs_t  # [TP]
    experts_t = local_expert(topk_ids_ptr, expert_map_ptr, slots_t, num_experts, num_local_experts, HAS_MAP,
                             offs_t < TOPK)  # [TP]
    if APPLY_WEIGHTS:
        weights_t = tl.load(topk_weights_ptr + slots_t, mask=experts_t >= 0, other=0.0)
    else:
        weights_t = tl.where(experts_t >= 0, 1.0, 0.0)  # [TP]
    num_k = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, TOPK * num_k):
        t = i // num_k
        k0 = (i - t * num_k) * BLOCK_K
        slot = pid_m * TOPK + t
        expert, scale = _slot_of(experts_t, weights_t, offs_t, t)
        computed = expert >= 0
        safe_expert = tl.maximum(expert, 0)
        mask_a = row0 & computed  # [BM, 1]
        mask_b = mask_n[None, :] & computed  # [1, BN]
        if not EVEN_K:
            mask_a = mask_a & ((k0 + offs_k)[None, :] < K)
            mask_b = mask_b & ((k0 + b_k)[:, None] < K)
        a = tl.load(a_ptr + slot * stride_am + (k0 + offs_k)[None, :] * stride_ak + offs_bm[:, None] * 0,
                    mask=mask_a, other=0.0)  # [BM, BK]
        b = tl.load(w_ptr + safe_expert * stride_we + (weight_k(k0, QUANT) + offs_wk)[:, None] * stride_wk
                    + offs_n[None, :] * stride_wn, mask=mask_b, other=0.0)  # [BK, BN] ([BK/2, BN] 4-bit)
        if QUANT == "none":
            acc += tl.dot(a, b, input_precision=PRECISION) * scale
        elif QUANT == "int4" or QUANT == "int8" or QUANT == "mxfp4":
            part = dequant_dot(a, b, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                               w_scale_ptr + safe_expert * stride_wse + offs_n * stride_wsn,
                               w_zp_ptr + safe_expert * stride_zpe + zp_rows * stride_zpn, zp_shift, k0, K,
                               stride_wsk, stride_zpk, mask_n & computed, BLOCK_K, GROUP_K, QUANT, HAS_ZP,
                               PRECISION, ASM_UNPACK, False)  # [BM, BN]
            acc += part * scale
        else:
            part = tl.dot(a, b, input_precision=PRECISION)  # [BM, BN]
            if QUANT == "block":
                g = k0 // GROUP_K
                a_s = tl.load(a_scale_ptr + slot * stride_asm + g * stride_ask, mask=computed, other=0.0)
                b_s = tl.load(w_scale_ptr + safe_expert * stride_wse + (offs_n // GROUP_N) * stride_wsn
                              + g * stride_wsk, mask=mask_n & computed, other=0.0)  # [BN]
            else:  # "scaled": one scale per slot (or tensor) and per output column (or expert)
                a_s = tl.load(a_scale_ptr + slot * stride_asm, mask=computed, other=0.0)
                b_s = tl.load(w_scale_ptr + safe_expert * stride_wse + offs_n * stride_wsn,
                              mask=mask_n & computed, other=0.0)  # [BN]
            acc += part * (scale * a_s) * b_s[None, :]
    pdl_launch_dependents(USE_PDL)
    if HAS_BIAS:
        for t in tl.static_range(TOPK):
            expert, scale = _slot_of(experts_t, weights_t, offs_t, t)
            bias = tl.load(bias_ptr + tl.maximum(expert, 0) * stride_be + offs_n, mask=mask_n & (expert >= 0),
                           other=0.0).to(tl.float32)  # [BN]
            acc += (bias * scale)[None, :]
    out_ptrs = out_ptr + pid_m * stride_om + offs_n[None, :] * stride_on + offs_bm[:, None] * 0  # [BM, BN]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row0 & mask_n[None, :])


@with_interpreter_fixes
@planned
def moe_down_reduce(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    config: GemmConfig,
    *,
    topk_weights: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    scales: Scales | WeightScales | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[m] = sum_t w[m, t] * (a[m * topk + t] @ w[e].T + bias[e]), e the local expert of slot (m, t).

    Args:
        a: (M * topk, N) intermediate in slot order, float or fp8 (then ``scales``: per slot or
            per tensor, or per 1 x bk group with ``block_shape``).
        w: (E, K, N) down weights; out: (M, K), overwritten.
        topk_ids: (M, topk) int32/int64, contiguous; ids outside [0, num_experts), or mapped by
            ``expert_map`` (num_experts,) int32 outside [0, E) (-1: remote), contribute exactly zero.
        config: tiles; block_m is 16 (row 0 of each tile is the token).
        topk_weights: (M, topk) float32 contiguous, or None for weight 1 (applied on the input).
        bias: (E, K), added per slot before its weight.
    Shapes were checked by the caller. Planned: the body runs once per static signature.
    """
    m, topk = topk_ids.shape
    n_out, k = w.shape[1], a.shape[1]
    if m == 0 or n_out == 0:
        return out
    config = fit_shared_memory(config, a.element_size(), gated=False, budget=shared_memory_budget(a.device),
                               weight_size=weight_bytes(scales, w))
    config = fit_low_bit(config, scales)
    sargs = scale_args(scales, a, w, config, config.block_n)
    sargs.pop("stride_ase")
    grid = (m * cdiv(n_out, config.block_n),)
    return Launch(_moe_down_reduce_kernel, grid, dict(
        a_ptr=a, w_ptr=w, out_ptr=out, topk_weights_ptr=topk_weights if topk_weights is not None else w, topk_ids_ptr=topk_ids,
        expert_map_ptr=expert_map if expert_map is not None else topk_ids,
        bias_ptr=bias if bias is not None else w, stride_be=bias.stride(0) if bias is not None else 0,
        N=n_out, K=k, num_tokens=m, num_experts=num_experts, num_local_experts=w.shape[0],
        stride_am=a.stride(0), stride_ak=a.stride(1),
        stride_we=w.stride(0), stride_wn=w.stride(1), stride_wk=w.stride(2),
        stride_om=out.stride(0), stride_on=out.stride(1),
        TOPK=topk, TOPK_P2=max(2, next_power_of_2(topk)), BLOCK_M=16, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        APPLY_WEIGHTS=topk_weights is not None, HAS_MAP=expert_map is not None, HAS_BIAS=bias is not None,
        EVEN_K=k % config.block_k == 0, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **sargs, **pdl_args(),
    ), out)
