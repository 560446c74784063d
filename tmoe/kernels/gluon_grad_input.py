"""The input gradient's M-grouped GEMM on the warp-specialized Hopper engine (Gluon), the twin of
``moe_grad_input``'s TMA path: per aligned row block of expert e and BLOCK_N output columns,
``da = d @ w[e]`` with ``d`` (P, R) aligned rows and ``w`` (E, R, C) read as stored (R the reduced
dimension, rows of a 2-D (E * R, C) view; R a multiple of block_k so a K step never crosses experts).
A one-warp producer streams d's [BM, BK] and w's [BK, BN] tiles by TMA into the ring; the consumer
warp groups multiply (B N-major) and store each real row at its slot, or every row in aligned order
(``SORTED_OUT``); with ``ROUTER_GRAD`` the first column block also sums each row's partial
router-weight gradients in a fixed order, as the ``tl`` kernel does. No atomics."""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from tmoe.kernels._details.ws_engine import (
    LOADER_REGS, alloc_ring, mainloop, mma_layout, ring_slot, tile_grid, tile_ids, tma_load,
)
from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels.gluon_grouped import ring_stages
from tmoe.kernels.gluon_matmul import descriptor, max_registers
from tmoe.runtime.launch import launch


@gluon.jit
def _grad_input_loader(d_desc, w_desc, a_bufs, b_bufs, ready, empty, expert_ids_ptr, num_post_padded_ptr, R, C,
                       NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    BLOCK_M: gl.constexpr = d_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = d_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    num_valid_m = gl.load(num_post_padded_ptr) // BLOCK_M
    num_tiles, num_pid_n, k_tiles = tile_grid(num_valid_m, C, R, BLOCK_N, BLOCK_K)
    counter = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = tile_ids(tile, num_valid_m, num_pid_n, GROUP_M)
        w_row = gl.load(expert_ids_ptr + pid_m) * R
        for ki in range(k_tiles):
            s, phase = ring_slot(counter, NUM_STAGES)
            mbarrier.wait(empty.index(s), phase ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, d_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma_load(d_desc, [pid_m * BLOCK_M, ki * BLOCK_K], bar, a_bufs.index(s))
            tma_load(w_desc, [w_row + ki * BLOCK_K, pid_n * BLOCK_N], bar, b_bufs.index(s))
            counter += 1


@gluon.jit
def _grad_input_consumer(a_bufs, b_bufs, ready, empty, partial_ptr, sorted_ids_ptr, num_post_padded_ptr, out_ptr,
                         grad_weights_ptr, num_slots, R, C, num_parts, stride_om, stride_pm,
                         NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                         PARTS_BLOCK: gl.constexpr, ROUTER_GRAD: gl.constexpr, SORTED_OUT: gl.constexpr,
                         num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    layout: gl.constexpr = mma_layout(a_bufs.dtype, BLOCK_M, BLOCK_N, num_warps)
    parts_layout: gl.constexpr = gl.BlockedLayout([1, PARTS_BLOCK], [32, 1], [num_warps, 1], [1, 0])
    num_valid_m = gl.load(num_post_padded_ptr) // BLOCK_M
    num_tiles, num_pid_n, k_tiles = tile_grid(num_valid_m, C, R, BLOCK_N, BLOCK_K)
    counter = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = tile_ids(tile, num_valid_m, num_pid_n, GROUP_M)
        if ROUTER_GRAD:
            if pid_n == 0:  # the router weights' gradient: the row's partials, in column-block order
                rows_p = pid_m.to(gl.int64) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, parts_layout))
                slots_p = gl.load(sorted_ids_ptr + rows_p).to(gl.int64)
                acc_w = gl.zeros((BLOCK_M, ), dtype=gl.float32, layout=gl.SliceLayout(1, parts_layout))
                for c0 in range(0, num_parts, PARTS_BLOCK):
                    offs_c = c0 + gl.arange(0, PARTS_BLOCK, layout=gl.SliceLayout(0, parts_layout))
                    part = gl.load(partial_ptr + rows_p[:, None] * stride_pm + offs_c[None, :],
                                   mask=offs_c[None, :] < num_parts, other=0.0)  # [BM, PB]
                    acc_w += gl.sum(part, axis=1)
                gl.store(grad_weights_ptr + slots_p, acc_w, mask=slots_p < num_slots)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
        acc, _, counter = mainloop(a_bufs, b_bufs, b_bufs, ready, empty, counter, k_tiles, acc, acc, NUM_STAGES,
                                   False, True)
        rows = pid_m.to(gl.int64) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))  # [BM]
        offs_n = pid_n.to(gl.int64) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))  # [BN]
        mask_n = offs_n < C
        if SORTED_OUT:  # every row of the block (padding rows: zero rows of d give zeros)
            gl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=mask_n[None, :])
        else:
            slots = gl.load(sorted_ids_ptr + rows).to(gl.int64)
            mask_m = slots < num_slots
            gl.store(out_ptr + gl.where(mask_m, slots, 0)[:, None] * stride_om + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@gluon.jit
def _gluon_grad_input_kernel(d_desc, w_desc, partial_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, out_ptr,
                             grad_weights_ptr, num_slots, R, C, num_parts, stride_om, stride_pm,
                             NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                             PARTS_BLOCK: gl.constexpr, ROUTER_GRAD: gl.constexpr, SORTED_OUT: gl.constexpr,
                             num_warps: gl.constexpr):
    a_bufs, b_bufs, _, ready, empty = alloc_ring(d_desc, w_desc, NUM_STAGES, False)
    gl.warp_specialize([
        (_grad_input_consumer, (a_bufs, b_bufs, ready, empty, partial_ptr, sorted_ids_ptr, num_post_padded_ptr,
                                out_ptr, grad_weights_ptr, num_slots, R, C, num_parts, stride_om, stride_pm,
                                NUM_PROGRAMS, GROUP_M, NUM_STAGES, PARTS_BLOCK, ROUTER_GRAD, SORTED_OUT, num_warps)),
        (_grad_input_loader, (d_desc, w_desc, a_bufs, b_bufs, ready, empty, expert_ids_ptr, num_post_padded_ptr, R,
                              C, NUM_PROGRAMS, GROUP_M, NUM_STAGES)),
    ], [1], [LOADER_REGS])


def gluon_grad_input_fits(d: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_m: int, config: GemmConfig,
                          scale: torch.Tensor | None, skip_remote: bool) -> bool:
    """Whether the engine runs this input gradient: bf16/fp16 d, w and out of one dtype, no
    frozen-fp8 scales, no remote blocks (no expert map), w contiguous with R a multiple of block_k
    (a K step stays inside an expert), rows and columns TMA-addressable, block_m 64 or 128."""
    r, c = w.shape[1:]
    return (d.dtype in (torch.bfloat16, torch.float16) and w.dtype == d.dtype and out.dtype == d.dtype
            and scale is None and not skip_remote and w.is_contiguous() and r % config.block_k == 0
            and block_m in (64, 128) and d.stride(-1) == 1 and d.stride(0) * d.element_size() % 16 == 0
            and c * w.element_size() % 16 == 0)


def invoke_gluon_grad_input(d: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                            expert_ids: torch.Tensor, num_post_padded: torch.Tensor, num_slots: int, block_m: int,
                            config: GemmConfig, programs: int, partial: torch.Tensor | None = None,
                            grad_weights: torch.Tensor | None = None, parts_block: int = 16) -> None:
    """``da = d @ w[e]`` per aligned row block on the engine (``gluon_grad_input_fits`` holds; sm_90),
    as ``moe_grad_input._launch``: rows of ``out`` = slots with ``partial`` (and the router weights'
    gradient into ``grad_weights`` (num_slots,) float32), else aligned rows. ``config``: block_n,
    block_k, group_m, num_warps; ``programs``: persistent programs (the SM count)."""
    e, r, c = w.shape
    bn, bk = config.block_n, config.block_k
    num_tiles = expert_ids.shape[0] * triton.cdiv(c, bn)
    if num_tiles == 0:
        return
    programs = min(programs, num_tiles)
    router_grad = partial is not None
    launch(_gluon_grad_input_kernel, (programs, ),
           d_desc=descriptor(d, [block_m, bk]), w_desc=descriptor(w.view(e * r, c), [bk, bn]),
           partial_ptr=partial if router_grad else out, sorted_ids_ptr=sorted_ids, expert_ids_ptr=expert_ids,
           num_post_padded_ptr=num_post_padded, out_ptr=out, grad_weights_ptr=grad_weights if router_grad else out,
           num_slots=num_slots, R=r, C=c, num_parts=partial.shape[1] if router_grad else 0, stride_om=out.stride(0),
           stride_pm=partial.stride(0) if router_grad else 0, NUM_PROGRAMS=programs, GROUP_M=config.group_m,
           NUM_STAGES=ring_stages((block_m + bn) * bk * d.element_size(), 0), PARTS_BLOCK=parts_block,
           ROUTER_GRAD=router_grad, SORTED_OUT=not router_grad, num_warps=config.num_warps,
           maxnreg=max_registers(config.num_warps))

