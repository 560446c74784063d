"""The grouped expert GEMMs on the warp-specialized Hopper engine (Gluon), the twin of
``moe_grouped_gemm``'s ``tl`` core for float operands: the same sorted rows, align metadata, tile
order, outputs and epilogue math, with a one-warp TMA producer streaming A and weight tiles through
a ring of shared-memory stages while the consumer warp groups (the default partition) multiply and
run the epilogue, so the loads of a tile's stages and the next tile's overlap the MMAs and the
epilogue.

A (EM, K) holds the routed rows in the align stage's order, each expert's run padded to block_m, so
a row block belongs to one expert; the weights (E, N_w, K) are read as a 2-D (E * N_w, K) view (N_w a
multiple of block_n: a tile never crosses experts). The valid tile count comes from
num_tokens_post_padded in device memory. The up GEMM (``GATED``) loads the gate and up tiles of the
same columns and applies the activation (``common._act_and_mul``/``_act_no_mul``, the ``tl`` kernels'
own code) and stores its intermediate in sorted order through TMA; the down GEMM stores each row at
its slot (``sorted_token_ids``), padding rows never. Either may multiply the router weight."""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from tmoe.kernels._details.common import _act_and_mul, _act_no_mul
from tmoe.kernels._details.ws_engine import (
    LOADER_REGS, alloc_ring, load_stage, mainloop, mma_layout, ring_slot, tile_grid, tile_ids, tma_store,
)
from tmoe.kernels.activation import Activation
from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels.gluon_matmul import GL_DTYPES, descriptor, max_registers
from tmoe.kernels.gemm_args import scale_args
from tmoe.kernels.operands import Routing, Scales
from tmoe.runtime.launch import launch

gl_act_and_mul = gluon.jit(_act_and_mul)
gl_act_no_mul = gluon.jit(_act_no_mul)

STAGE_BUDGET = 226 * 1024  # bytes of Hopper's 227 KB per block for the ring and the epilogue buffer
MAX_STAGES = 6


@gluon.jit
def _grouped_loader(a_desc, w_desc, a_bufs, b_bufs, b2_bufs, ready, empty, expert_ids_ptr, num_post_padded_ptr,
                    N, N_W, K, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                    MUL: gl.constexpr, SPLIT_N: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    num_valid_m = gl.load(num_post_padded_ptr) // BLOCK_M
    num_tiles, num_pid_n, k_tiles = tile_grid(num_valid_m, N, K, BLOCK_N * (1 + SPLIT_N), BLOCK_K)
    second = N if MUL else BLOCK_N  # rows of the second weight tile past the first: up rows, or the next columns
    counter = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = tile_ids(tile, num_valid_m, num_pid_n, GROUP_M)
        w_row = gl.load(expert_ids_ptr + pid_m) * N_W + pid_n * BLOCK_N * (1 + SPLIT_N)  # the gate (or only) rows
        for ki in range(k_tiles):
            s, phase = ring_slot(counter, NUM_STAGES)
            mbarrier.wait(empty.index(s), phase ^ 1)
            load_stage(a_desc, w_desc, pid_m * BLOCK_M, w_row, w_row + second, ki * BLOCK_K, ready.index(s),
                       a_bufs.index(s), b_bufs.index(s), b2_bufs.index(s), MUL or SPLIT_N)
            counter += 1


@gluon.jit
def _store_slot_rows(acc, offs_n, safe_slots, mask_m, weight, bias_ptrs, out_ptr, N, stride_om,
                     MUL_ROUTED_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr):
    """The down GEMM's epilogue of one accumulator: + bias, * router weight, each real row stored at
    its slot."""
    mask_n = offs_n < N
    if HAS_BIAS:
        acc += gl.load(bias_ptrs, mask=mask_n, other=0.0).to(gl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        acc = acc * weight[:, None]
    ptrs = out_ptr + safe_slots[:, None] * stride_om + offs_n[None, :]  # [BM, BN]
    gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@gluon.jit
def _grouped_epilogue(acc, acc2, rows, row_0, pid_n, expert, out_ptr, c_desc, c_smem, sorted_ids_ptr, topk_weights_ptr,
                      a_scale_ptr, w_scale_ptr, bias_ptr, pre_ptr, N, N_W, num_slots, stride_om, stride_asm,
                      stride_wse, stride_wsn, stride_be, stride_pm, act_alpha, act_limit, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, GATED: gl.constexpr, MUL: gl.constexpr, SPLIT_N: gl.constexpr,
                      ACTIVATION: gl.constexpr, CLAMP: gl.constexpr, MUL_ROUTED_WEIGHT: gl.constexpr,
                      SCALED: gl.constexpr, HAS_BIAS: gl.constexpr, SAVE_PRE: gl.constexpr):
    """``moe_tile_matmul_tma``'s scaling and ``moe_epilogue``'s steps, in their order, on the
    accumulators in the wgmma layout. ``acc2``: the up GEMM's up half (MUL), or the down GEMM's next
    BLOCK_N columns (SPLIT_N). SCALED (fp8 per-token/tensor activations, per-channel/tensor weights)
    rescales; the up GEMM (GATED) saves the pre-activation (SAVE_PRE, row = slot), takes the router
    weight and the bias, applies the activation and stores its sorted rows through TMA; the down
    GEMM adds the bias, takes the router weight and stores each real row at its slot."""
    layout: gl.constexpr = acc.type.layout
    offs_n = pid_n.to(gl.int64) * BLOCK_N * (1 + SPLIT_N) + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    offs_2 = offs_n + (N if MUL else BLOCK_N)  # [BN] weight rows (and, SPLIT_N, output columns) of acc2
    mask_n = offs_n < N
    slots = gl.load(sorted_ids_ptr + rows).to(gl.int64)  # [BM]; padding rows hold num_slots
    mask_m = slots < num_slots
    safe_slots = gl.where(mask_m, slots, 0)
    if SCALED:
        a_s = gl.load(a_scale_ptr + rows * stride_asm)  # [BM]: sorted rows, all addressable
        w_s = w_scale_ptr + expert.to(gl.int64) * stride_wse
        acc = acc * a_s[:, None] * gl.load(w_s + offs_n * stride_wsn, mask=offs_n < N_W, other=0.0)[None, :]
        if MUL or SPLIT_N:
            acc2 = acc2 * a_s[:, None] * gl.load(w_s + offs_2 * stride_wsn, mask=offs_2 < N_W, other=0.0)[None, :]
    if MUL_ROUTED_WEIGHT:
        weight = gl.load(topk_weights_ptr + safe_slots, mask=mask_m, other=0.0)  # [BM]
    else:
        weight = gl.where(mask_m, 1.0, 0.0)  # unread
    bias = bias_ptr + expert.to(gl.int64) * stride_be
    if GATED:
        if SAVE_PRE:  # x @ W1 of the tile, before the router weight and the bias
            pre = pre_ptr + safe_slots[:, None] * stride_pm + offs_n[None, :]  # [BM, BN]
            mask_pre = mask_m[:, None] & mask_n[None, :]
            gl.store(pre, acc.to(pre_ptr.dtype.element_ty), mask=mask_pre)
            if MUL:
                gl.store(pre + N, acc2.to(pre_ptr.dtype.element_ty), mask=mask_pre)
        if MUL_ROUTED_WEIGHT:
            acc = acc * weight[:, None]
        if HAS_BIAS:
            acc += gl.load(bias + offs_n, mask=mask_n, other=0.0).to(gl.float32)[None, :]
        if MUL:
            if MUL_ROUTED_WEIGHT:
                acc2 = acc2 * weight[:, None]
            if HAS_BIAS:
                acc2 += gl.load(bias + offs_2, mask=mask_n, other=0.0).to(gl.float32)[None, :]
            acc = gl_act_and_mul(acc, acc2, act_alpha, act_limit, ACTIVATION, CLAMP)
        else:
            acc = gl_act_no_mul(acc, ACTIVATION)
        tma.store_wait(pendings=0)  # the previous tile's store has left c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma_store(c_desc, [row_0, pid_n * BLOCK_N], c_smem)
    else:
        _store_slot_rows(acc, offs_n, safe_slots, mask_m, weight, bias + offs_n, out_ptr, N, stride_om,
                         MUL_ROUTED_WEIGHT, HAS_BIAS)
        if SPLIT_N:
            _store_slot_rows(acc2, offs_2, safe_slots, mask_m, weight, bias + offs_2, out_ptr, N, stride_om,
                             MUL_ROUTED_WEIGHT, HAS_BIAS)


@gluon.jit
def _grouped_consumer(a_bufs, b_bufs, b2_bufs, ready, empty, c_desc, c_smem, out_ptr, sorted_ids_ptr, expert_ids_ptr,
                      num_post_padded_ptr, topk_weights_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, pre_ptr, N, N_W, K,
                      num_slots, stride_om, stride_asm, stride_wse, stride_wsn, stride_be, stride_pm, act_alpha,
                      act_limit, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                      BLOCK_N: gl.constexpr, GATED: gl.constexpr, MUL: gl.constexpr, ACTIVATION: gl.constexpr,
                      CLAMP: gl.constexpr, MUL_ROUTED_WEIGHT: gl.constexpr, SCALED: gl.constexpr,
                      HAS_BIAS: gl.constexpr, SAVE_PRE: gl.constexpr, SPLIT_N: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    layout: gl.constexpr = mma_layout(a_bufs.dtype, BLOCK_M, BLOCK_N, num_warps)
    num_valid_m = gl.load(num_post_padded_ptr) // BLOCK_M
    num_tiles, num_pid_n, k_tiles = tile_grid(num_valid_m, N, K, BLOCK_N * (1 + SPLIT_N), BLOCK_K)
    counter = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = tile_ids(tile, num_valid_m, num_pid_n, GROUP_M)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
        acc, acc2, counter = mainloop(a_bufs, b_bufs, b2_bufs, ready, empty, counter, k_tiles, acc, acc, NUM_STAGES,
                                      MUL or SPLIT_N)
        rows = pid_m.to(gl.int64) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))  # [BM]
        _grouped_epilogue(acc, acc2, rows, pid_m * BLOCK_M, pid_n, gl.load(expert_ids_ptr + pid_m), out_ptr, c_desc, c_smem,
                          sorted_ids_ptr, topk_weights_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, pre_ptr, N, N_W,
                          num_slots, stride_om, stride_asm, stride_wse, stride_wsn, stride_be, stride_pm, act_alpha,
                          act_limit, BLOCK_M, BLOCK_N, GATED, MUL, SPLIT_N, ACTIVATION, CLAMP, MUL_ROUTED_WEIGHT,
                          SCALED, HAS_BIAS, SAVE_PRE)
    if GATED:
        tma.store_wait(pendings=0)


@gluon.jit
def _gluon_grouped_kernel(a_desc, w_desc, c_desc, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
                          topk_weights_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, pre_ptr, N, N_W, K, num_slots,
                          stride_om, stride_asm, stride_wse, stride_wsn, stride_be, stride_pm, act_alpha, act_limit,
                          NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                          GATED: gl.constexpr, MUL: gl.constexpr, ACTIVATION: gl.constexpr, CLAMP: gl.constexpr,
                          MUL_ROUTED_WEIGHT: gl.constexpr, SCALED: gl.constexpr, HAS_BIAS: gl.constexpr,
                          SAVE_PRE: gl.constexpr, SPLIT_N: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    a_bufs, b_bufs, b2_bufs, ready, empty = alloc_ring(a_desc, w_desc, NUM_STAGES, MUL or SPLIT_N)
    if GATED:
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    else:
        c_smem = a_bufs.index(0)  # unused: the down GEMM stores by pointers
    gl.warp_specialize([
        (_grouped_consumer, (a_bufs, b_bufs, b2_bufs, ready, empty, c_desc, c_smem, out_ptr, sorted_ids_ptr,
                             expert_ids_ptr, num_post_padded_ptr, topk_weights_ptr, a_scale_ptr, w_scale_ptr, bias_ptr,
                             pre_ptr, N, N_W, K, num_slots, stride_om, stride_asm, stride_wse, stride_wsn, stride_be,
                             stride_pm, act_alpha, act_limit, NUM_PROGRAMS, GROUP_M, NUM_STAGES, BLOCK_N, GATED, MUL,
                             ACTIVATION, CLAMP, MUL_ROUTED_WEIGHT, SCALED, HAS_BIAS, SAVE_PRE, SPLIT_N, num_warps)),
        (_grouped_loader, (a_desc, w_desc, a_bufs, b_bufs, b2_bufs, ready, empty, expert_ids_ptr, num_post_padded_ptr,
                           N, N_W, K, NUM_PROGRAMS, GROUP_M, NUM_STAGES, MUL, SPLIT_N)),
    ], [1], [LOADER_REGS])


# the down GEMM's 128 x block_n tile as two 128 x block_n / 2 accumulators, as the up GEMM's: H100, Mixtral M=4096
# 1820 -> 1697 µs, Qwen3 M=4096 375 -> 327, Mixtral M=1024 500 -> 512 (bench/results/gluon_grouped.csv)
SPLIT_DOWN = True


def ring_stages(stage_bytes: int, epilogue_bytes: int) -> int:
    """The ring's depth: as many stages of ``stage_bytes`` (A [BM, BK] and the weight tiles) as fit
    beside the epilogue buffer in STAGE_BUDGET, at most MAX_STAGES."""
    return max(2, min(MAX_STAGES, (STAGE_BUDGET - epilogue_bytes) // stage_bytes))


def gluon_grouped_fits(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: GemmConfig,
                       activation: Activation | None, gated: bool, scales: Scales | None) -> bool:
    """Whether the Gluon engine runs this grouped GEMM: bf16/fp16 rows and weights, or fp8 ones with
    per-token/per-tensor and per-channel/per-tensor scales (``scales``); a bf16/fp16 output; N_w a
    multiple of block_n (tiles stay inside an expert), gate and up not interleaved, block_m 64 or
    128. The other cases (block scales, fused output quantization) keep the ``tl`` core."""
    n_w = w.shape[1]
    mul = gated and (activation or Activation()).mul
    n = n_w // 2 if mul else n_w
    fp8 = a.dtype == torch.float8_e4m3fn
    return (a.dtype in GL_DTYPES and w.dtype == a.dtype and out.dtype in (torch.bfloat16, torch.float16)
            and (scales is None) != fp8 and (scales is None or scales.block_shape is None)
            and config.block_m in (64, 128) and n % config.block_n == 0
            and not (mul and activation is not None and activation.interleaved)
            and all(t.stride(-1) == 1 and t.stride(-2) * t.element_size() % 16 == 0 for t in (a, out))
            and w.is_contiguous())


def invoke_gluon_grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: GemmConfig,
                              routing: Routing, programs: int, *, gated: bool, activation: Activation | None = None,
                              topk_weights: torch.Tensor | None = None, scales: Scales | None = None,
                              bias: torch.Tensor | None = None, pre_out: torch.Tensor | None = None) -> torch.Tensor:
    """One expert GEMM on the Gluon engine (``gluon_grouped_fits`` holds; sm_90), the arguments as
    ``moe_grouped_gemm.invoke_grouped_gemm``'s: ``a`` (EM, K) sorted rows, ``w`` (E, N_w, K);
    ``gated``: ``out`` (EM, N) in sorted order after the activation; else ``out`` (num_slots, N),
    row = slot. ``topk_weights`` ([num_slots] float32) multiplies each slot's accumulator;
    ``scales`` (fp8: per-token or per-tensor rows, per-channel or per-tensor weights), ``bias``
    (E, N_w), ``pre_out`` (gated: (num_slots, N_w), the saved pre-activation). ``programs``:
    persistent programs (the SM count)."""
    act = (activation or Activation()) if gated else None
    mul = act is not None and act.mul
    e, n_w, k = w.shape
    n = n_w // 2 if mul else n_w
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    num_tiles = routing.expert_ids.shape[0] * triton.cdiv(n, bn)
    if num_tiles == 0:
        return out
    programs = min(programs, num_tiles)
    split = not gated and SPLIT_DOWN and bn >= 128
    bn_w = bn // 2 if split else bn  # rows of one weight tile (one accumulator's columns)
    a_desc = descriptor(a, [bm, bk])
    c_desc = descriptor(out, [bm, bn]) if gated else a_desc  # the down GEMM stores by pointers
    stages = ring_stages((bm + bn_w * (1 + (mul or split))) * bk * a.element_size(),
                         bm * bn * out.element_size() if gated else 0)
    alpha, limit, clamp = act.floats() if act is not None else (1.0, 0.0, False)
    sa = scale_args(scales, a, w, config, bn)
    launch(_gluon_grouped_kernel, (programs, ),
           a_desc=a_desc, w_desc=descriptor(w.view(e * n_w, k), [bn_w, bk]), c_desc=c_desc,
           out_ptr=out, sorted_ids_ptr=routing.sorted_token_ids, expert_ids_ptr=routing.expert_ids,
           num_post_padded_ptr=routing.num_tokens_post_padded,
           topk_weights_ptr=topk_weights if topk_weights is not None else out,
           a_scale_ptr=sa["a_scale_ptr"], w_scale_ptr=sa["w_scale_ptr"], bias_ptr=bias if bias is not None else out,
           pre_ptr=pre_out if pre_out is not None else out,
           N=n, N_W=n_w, K=k, num_slots=routing.num_slots, stride_om=out.stride(0), stride_asm=sa["stride_asm"],
           stride_wse=sa["stride_wse"], stride_wsn=sa["stride_wsn"],
           stride_be=bias.stride(0) if bias is not None else 0,
           stride_pm=pre_out.stride(0) if pre_out is not None else 0, act_alpha=alpha, act_limit=limit,
           NUM_PROGRAMS=programs, GROUP_M=config.group_m, NUM_STAGES=stages, GATED=gated, MUL=mul,
           ACTIVATION=act.name if act is not None else "silu", CLAMP=clamp,
           MUL_ROUTED_WEIGHT=topk_weights is not None, SCALED=scales is not None, HAS_BIAS=bias is not None,
           SAVE_PRE=pre_out is not None, SPLIT_N=split, num_warps=config.num_warps,
           maxnreg=max_registers(config.num_warps))
    return out
