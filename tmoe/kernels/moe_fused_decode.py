"""Decode MoE as one pass over the weights plus a reduce: both expert GEMMs per (slot, block of the
intermediate), then each token's partial sums added in a fixed order.

Program (slot s, block j of BLOCK_N intermediate columns), e the slot's local expert, t its token:
    h = act(x[t] @ W1[e, block j rows].T + b1)   (gate and up rows; rounded to x's dtype, as the
                                                  two-GEMM path writes its intermediate)
    p[s, j, :] = w_s * (h @ W2[e, :, block j].T)  (+ w_s * b2[e] in block 0), float32
then ``out[t] = sum over the token's slots s and blocks j of p[s, j]`` (the reduce kernel, in one
fixed order: deterministic). The up and down weights of a slot are read once, in one launch,
and the intermediate never leaves registers; the launches of the aligned path (align, up GEMM,
down GEMM, top-k reduce) become two. Made for decode, where each slot has an expert of its own
(a slot that shares its expert with another reads the weights again). Row 0 of the [16, ...]
tiles is the token (the tensor cores take 16 rows; the others are masked). Low-bit weights
(``operands.WeightScales``) are dequantized in both GEMMs (``dequant.dequant_dot``; the down
GEMM's K is the intermediate, so block j is one K step). Slots of out-of-range or remote experts
compute nothing and are never read by the reduce. All offsets int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels._details.common import act_and_mul, act_no_mul, local_expert, split_gate_up, w1_columns
from tmoe.kernels._details.tile_matmul import moe_tile_matmul
from tmoe.kernels.activation import Activation
from tmoe.kernels.sizes import cdiv, next_power_of_2
from tmoe.kernels._details.dequant import b_rows, dequant_dot, weight_k, zero_point_rows
from tmoe.kernels.gemm_args import fit_shared_memory, scale_args, up_in_halves, weight_bytes
from tmoe.kernels.operands import WeightScales
from tmoe.runtime.device import shared_memory_budget
from tmoe.kernels.gemm_config import GemmConfig
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from tmoe.runtime.plan import Launch, planned


@triton.jit
def _up_tile(x_ptr, w1_ptr, w1_scale_ptr, w1_zp_ptr, expert, token, pid_n, row0, N, K,
             stride_xm, stride_xk, stride_w1e, stride_w1n, stride_w1k,
             stride_s1e, stride_s1n, stride_s1k, stride_z1e, stride_z1n, stride_z1k,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr, QUANT: tl.constexpr,
             HAS_ZP: tl.constexpr, MUL: tl.constexpr, INTERLEAVED: tl.constexpr, EVEN_K: tl.constexpr,
             PRECISION: tl.constexpr, ASM_UNPACK: tl.constexpr, HALVES: tl.constexpr):
    """float32 (gate [16, BN], up [16, BN]) of the token (row 0) for intermediate block ``pid_n``
    (up = gate when not MUL), W1's rows as in ``moe_gemm`` (``common.w1_columns``)."""
    w_cols, mask_c = w1_columns(pid_n, N, BLOCK_N, MUL, INTERLEAVED, HALVES)  # [BN] ([2BN] gate and up when MUL)
    zp_rows, zp_shift = zero_point_rows(w_cols, QUANT)
    offs_wk, _ = b_rows(BLOCK_K, QUANT)  # [BK] ([BK/2] 4-bit packed bytes)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_xm + offs_k[None, :] * stride_xk + tl.arange(0, 16)[:, None] * 0  # [16, BK]
    acc = moe_tile_matmul(
        x_ptrs, w1_ptr + expert * stride_w1e + offs_wk[:, None] * stride_w1k + w_cols[None, :] * stride_w1n,
        row0, mask_c, x_ptr + tl.arange(0, 16) * 0, w1_scale_ptr + expert * stride_s1e + w_cols * stride_s1n,
        w1_zp_ptr + expert * stride_z1e + zp_rows * stride_z1n, zp_shift,
        K, stride_xk, stride_w1k, 0, stride_s1k, stride_z1k,
        16, BLOCK_N * (1 + MUL), BLOCK_K, GROUP_K, QUANT, HAS_ZP, EVEN_K, PRECISION, ASM_UNPACK, False,
    )  # [16, BN] float32, [16, 2BN] when MUL
    if MUL:
        gate, up = split_gate_up(acc, 16, BLOCK_N, HALVES)
    else:
        gate = acc
        up = acc
    return gate, up


@triton.jit(do_not_specialize=['num_slots'])
def _moe_fused_decode_kernel(
    x_ptr,  # [num_tokens, K] float
    w1_ptr,  # [E, N_w, K]: N_w = 2N when MUL (gate rows, up rows; INTERLEAVED: 2j gate j, 2j + 1 up j), else N
    w2_ptr,  # [E, K, N]
    part_ptr,  # [num_slots, cdiv(N, BLOCK_N), K] float32
    topk_weights_ptr,  # [num_slots] float32 (APPLY_WEIGHTS)
    topk_ids_ptr,  # [num_slots] int32/int64
    expert_map_ptr,  # [num_experts] int32 (HAS_MAP)
    b1_ptr,  # [E, N_w] (HAS_B1)
    b2_ptr,  # [E, K] (HAS_B2)
    w1_scale_ptr, w1_zp_ptr,  # low-bit: W1's scales [E, N_w, K // GROUP_K] and zero points (HAS_ZP)
    w2_scale_ptr, w2_zp_ptr,  # low-bit: W2's scales [E, K, N // GROUP_K] and zero points (HAS_ZP)
    N, K, num_slots, num_experts, num_local_experts, act_alpha, act_limit,
    stride_xm, stride_xk, stride_w1e, stride_w1n, stride_w1k, stride_w2e, stride_w2k, stride_w2n,
    stride_ps, stride_pj, stride_b1e, stride_b2e,
    stride_s1e, stride_s1n, stride_s1k, stride_z1e, stride_z1n, stride_z1k,
    stride_s2e, stride_s2n, stride_s2k, stride_z2e, stride_z2n, stride_z2k,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KD: tl.constexpr, GROUP_K: tl.constexpr,
    QUANT: tl.constexpr, HAS_ZP: tl.constexpr, ASM_UNPACK_1: tl.constexpr, ASM_UNPACK_2: tl.constexpr,
    MUL: tl.constexpr, INTERLEAVED: tl.constexpr, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr,
    APPLY_WEIGHTS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, HALVES: tl.constexpr,
):
    pdl_wait(USE_PDL)  # PDL: before anything is read (pdl.py)
    # the slots of one intermediate block run side by side
    slot = (tl.program_id(0) % num_slots).to(tl.int64)
    pid_n = (tl.program_id(0) // num_slots).to(tl.int64)
    expert = local_expert(topk_ids_ptr, expert_map_ptr, slot, num_experts, num_local_experts, HAS_MAP)
    if expert < 0:  # remote or out of range: the reduce never reads this slot
        return
    row0 = tl.arange(0, 16) == 0  # [16]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < N
    gate, up = _up_tile(x_ptr, w1_ptr, w1_scale_ptr, w1_zp_ptr, expert, slot // TOPK, pid_n, row0, N, K,
                        stride_xm, stride_xk, stride_w1e, stride_w1n, stride_w1k,
                        stride_s1e, stride_s1n, stride_s1k, stride_z1e, stride_z1n, stride_z1k,
                        BLOCK_N, BLOCK_K, GROUP_K, QUANT, HAS_ZP, MUL, INTERLEAVED, EVEN_K, PRECISION, ASM_UNPACK_1,
                        HALVES)
    weight = 1.0
    if APPLY_WEIGHTS:
        weight = tl.load(topk_weights_ptr + slot)
    if WEIGHT_ON_INPUT:  # the weight scales the input, not the bias
        gate = gate * weight
        up = up * weight
    if HAS_B1:
        b1_ptrs = b1_ptr + expert * stride_b1e + offs_n * (1 + INTERLEAVED)  # [BN] (INTERLEAVED: gate at 2n)
        gate += tl.load(b1_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if MUL:
            up += tl.load(b1_ptrs + (1 if INTERLEAVED else N), mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if MUL:
        h = act_and_mul(gate, up, act_alpha, act_limit, ACTIVATION, CLAMP)
    else:
        h = act_no_mul(gate, ACTIVATION)
    h = tl.where(row0[:, None] & mask_n[None, :], h, 0.0).to(x_ptr.dtype.element_ty)  # [16, BN]
    # down: block j is the K step of h @ W2[e, cols, block j].T, for every BLOCK_KD chunk of output columns
    offs_wn, n_k = b_rows(BLOCK_N, QUANT)  # [BN] ([BN/2] 4-bit packed bytes) rows of the W2 tile
    w2_rows = w2_ptr + expert * stride_w2e + (weight_k(pid_n * BLOCK_N, QUANT) + offs_wn)[:, None] * stride_w2n
    mask_rows = (pid_n * BLOCK_N + n_k) < N
    if not WEIGHT_ON_INPUT:
        h_scale = weight
    else:
        h_scale = 1.0
    p_ptr = part_ptr + slot * stride_ps + pid_n * stride_pj
    for k0 in range(0, K, BLOCK_KD):
        cols = k0 + tl.arange(0, BLOCK_KD).to(tl.int64)  # [BKD] output columns
        mask_cols = cols < K
        q = tl.load(w2_rows + cols[None, :] * stride_w2k, mask=mask_rows[:, None] & mask_cols[None, :],
                    other=0.0)  # [BN, BKD] ([BN/2, BKD] 4-bit)
        if QUANT == "none":
            p = tl.dot(h, q, input_precision=PRECISION)  # [16, BKD]
        else:
            zp_rows, zp_shift = zero_point_rows(cols, QUANT)
            p = dequant_dot(h, q, tl.zeros((16, BLOCK_KD), dtype=tl.float32),
                            w2_scale_ptr + expert * stride_s2e + cols * stride_s2n,
                            w2_zp_ptr + expert * stride_z2e + zp_rows * stride_z2n, zp_shift, pid_n * BLOCK_N, N,
                            stride_s2k, stride_z2k, mask_cols, BLOCK_N, GROUP_K, QUANT, HAS_ZP, PRECISION,
                            ASM_UNPACK_2, False)  # [16, BKD]
        p = tl.sum(p, axis=0)  # [BKD]: rows 1-15 of h are zero
        if HAS_B2:
            p += tl.load(b2_ptr + expert * stride_b2e + cols, mask=mask_cols & (pid_n == 0), other=0.0).to(tl.float32)
        tl.store(p_ptr + cols, p * h_scale, mask=mask_cols)
    pdl_launch_dependents(USE_PDL)


@triton.jit
def _moe_partial_reduce_kernel(
    part_ptr,  # [num_tokens * TOPK * NUM_J, K] float32: rows (slot, block j), the token's slots adjacent
    topk_ids_ptr,  # [num_tokens * TOPK] int32/int64
    expert_map_ptr,  # [num_experts] int32 (HAS_MAP)
    out_ptr,  # [num_tokens, K]
    K, num_j, num_experts, num_local_experts, stride_om, stride_ok,
    TOPK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MAP: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    offs_k = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    mask_k = offs_k < K
    num_rows = TOPK * num_j
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for r0 in range(0, num_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)  # [BR] the token's (slot, block) rows
        slots = pid_m * TOPK + rows // num_j
        # rows of slots no local expert computed are never read: they contribute exactly zero
        computed = local_expert(topk_ids_ptr, expert_map_ptr, slots, num_experts, num_local_experts, HAS_MAP,
                                rows < num_rows) >= 0
        acc += tl.load(part_ptr + (pid_m * num_rows + rows)[:, None] * K + offs_k[None, :],
                       mask=computed[:, None] & mask_k[None, :], other=0.0)
    pdl_launch_dependents(USE_PDL)
    tl.store(out_ptr + pid_m * stride_om + offs_k * stride_ok, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty),
             mask=mask_k)


def _weight_args(i: int, scales: WeightScales | None, x: torch.Tensor, w: torch.Tensor, step: GemmConfig,
                 tile_n: int) -> dict:
    """W{i}'s low-bit launch arguments (scales, zero points, ``ASM_UNPACK_{i}``) for K steps of
    ``step.block_k`` over ``tile_n`` weight rows."""
    a = scale_args(scales, x, w, step, tile_n)
    return {f"w{i}_scale_ptr": a["w_scale_ptr"], f"stride_s{i}e": a["stride_wse"], f"stride_s{i}n": a["stride_wsn"],
            f"stride_s{i}k": a["stride_wsk"], f"w{i}_zp_ptr": a["w_zp_ptr"], f"stride_z{i}e": a["stride_zpe"],
            f"stride_z{i}n": a["stride_zpn"], f"stride_z{i}k": a["stride_zpk"], f"ASM_UNPACK_{i}": a["ASM_UNPACK"],
            "GROUP_K": a["GROUP_K"], "QUANT": a["QUANT"], "HAS_ZP": a["HAS_ZP"]}


# output columns per down-GEMM step: 256 beat 128 and 512 at the block_n the fused route takes
DOWN_STEP = 256


def fused_decode_blocks(n: int, config: GemmConfig) -> int:
    """Intermediate blocks per slot: the partial sums' middle dimension."""
    return cdiv(n, config.block_n)


@with_interpreter_fixes
@planned
def moe_fused_decode(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    partial: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    config: GemmConfig,
    *,
    n: int,
    activation: Activation = Activation(),
    topk_weights: torch.Tensor | None = None,
    weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    w1_scales: WeightScales | None = None,
    w2_scales: WeightScales | None = None,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """partial[s, j] = w_s * (act(x[s // topk] @ W1[e].T + b1)[block j] @ W2[e, :, block j].T (+ b2 in j = 0)).

    Args:
        x: (M, K) float activations; w1 (E, N_w, K), w2 (E, K, N) (low-bit: codes, ``w*_scales``);
            n: the intermediate size N (the call's ``MoEProblem.n``).
        partial: (M * topk, fused_decode_blocks(N, config), K) float32; rows of slots that no
            local expert computes are not written (``moe_partial_reduce`` skips them).
        topk_ids: (M, topk) int32/int64, contiguous; ids outside [0, num_experts), or mapped by
            ``expert_map`` outside [0, E), are skipped.
        config: block_n intermediate columns per program, block_k the up GEMM's K step (the down
            GEMM's: DOWN_STEP output columns).
        topk_weights: (M, topk) float32 contiguous; ``weight_on_input``: it scales x (not b1), else
            the slot's down product and b2.
        w1_bias (E, N_w), w2_bias (E, K). ``activation`` as ``invoke_moe_gemm``'s.
    Shapes were checked by the caller. Planned: the body runs once per static signature.
    """
    m, topk = topk_ids.shape
    mul = activation.mul
    k = x.shape[1]
    if m == 0 or n == 0 or k == 0:
        return partial
    budget = shared_memory_budget(x.device)
    config = fit_shared_memory(config, x.element_size(), mul, budget, weight_bytes(w1_scales, w1))  # the up loop's tiles
    bn, bk = config.block_n, config.block_k
    bkd = min(DOWN_STEP, max(16, next_power_of_2(k)))
    w2_size = weight_bytes(w2_scales, w2)
    while (config.num_stages - 1) * bkd * bn * w2_size > budget and bkd > 32:  # the down loop's tiles in flight
        bkd //= 2
    unused = w1
    return Launch(_moe_fused_decode_kernel, (m * topk * cdiv(n, bn),), dict(
        x_ptr=x, w1_ptr=w1, w2_ptr=w2, part_ptr=partial,
        topk_weights_ptr=topk_weights if topk_weights is not None else unused, topk_ids_ptr=topk_ids,
        expert_map_ptr=expert_map if expert_map is not None else topk_ids,
        b1_ptr=w1_bias if w1_bias is not None else unused, b2_ptr=w2_bias if w2_bias is not None else unused,
        N=n, K=k, num_slots=m * topk, num_experts=num_experts, num_local_experts=w1.shape[0],
        stride_xm=x.stride(0), stride_xk=x.stride(1),
        stride_w1e=w1.stride(0), stride_w1n=w1.stride(1), stride_w1k=w1.stride(2),
        stride_w2e=w2.stride(0), stride_w2k=w2.stride(1), stride_w2n=w2.stride(2),
        stride_ps=partial.stride(0), stride_pj=partial.stride(1),
        stride_b1e=w1_bias.stride(0) if w1_bias is not None else 0,
        stride_b2e=w2_bias.stride(0) if w2_bias is not None else 0,
        **{**_weight_args(1, w1_scales, x, w1, config, bn * (1 + mul)),  # the two share GROUP_K, QUANT, HAS_ZP
           **_weight_args(2, w2_scales, x, w2, GemmConfig(16, bkd, bn, num_warps=config.num_warps), bkd)},
        TOPK=topk, BLOCK_N=bn, BLOCK_K=bk, BLOCK_KD=bkd, **activation.kernel_args(),
        HALVES=up_in_halves(w1, mul, activation.interleaved),
        APPLY_WEIGHTS=topk_weights is not None, WEIGHT_ON_INPUT=weight_on_input,
        HAS_MAP=expert_map is not None, HAS_B1=w1_bias is not None, HAS_B2=w2_bias is not None,
        EVEN_K=k % bk == 0, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(),
    ), partial)


@with_interpreter_fixes
@planned
def moe_partial_reduce(partial: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out: torch.Tensor, *,
                       expert_map: torch.Tensor | None = None, num_local_experts: int) -> torch.Tensor:
    """out[t] = sum of partial[s, j] over the token's slots s (those a local expert computed) and
    blocks j, in float32, in one fixed order. partial (M * topk, J, K) float32 contiguous as
    ``moe_fused_decode`` wrote it; out (M, K). Shapes were checked by the caller."""
    m, topk = topk_ids.shape
    num_j, k = partial.shape[1], partial.shape[2]
    if m == 0 or k == 0:
        return out
    block_k = min(128, next_power_of_2(k))
    return Launch(_moe_partial_reduce_kernel, (m, cdiv(k, block_k)), dict(
        part_ptr=partial, topk_ids_ptr=topk_ids, expert_map_ptr=expert_map if expert_map is not None else topk_ids,
        out_ptr=out, K=k, num_j=num_j, num_experts=num_experts, num_local_experts=num_local_experts,
        stride_om=out.stride(0), stride_ok=out.stride(1),
        TOPK=topk, BLOCK_R=min(32, next_power_of_2(topk * num_j)), BLOCK_K=block_k, HAS_MAP=expert_map is not None,
        num_warps=4, **pdl_args(),
    ), out)
