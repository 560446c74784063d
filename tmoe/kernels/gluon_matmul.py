"""Dense ``C = A @ B^T`` on the warp-specialized Hopper engine (``_details.ws_engine``), the engine's
yardstick against cuBLAS (``bench/repro_gluon_dense.py``): A (M, K), B (N, K) as nn.Linear stores
its weight, C (M, N), bf16/fp16 in, fp32 accumulation. Persistent: one program per SM walks the
output tiles in grouped order (``GROUP_M`` row blocks per column sweep); a one-warp producer streams
A and B tiles by TMA; the consumer warp groups multiply and store through TMA."""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tmoe.kernels._details.ws_engine import (
    LOADER_REGS, alloc_ring, load_stage, mainloop, mma_layout, ring_slot, tile_grid, tile_ids, tma_store,
)
from tmoe.kernels.gemm_config import GemmConfig

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}


@gluon.jit
def _dense_loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, NUM_PROGRAMS: gl.constexpr,
                  GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_tiles, num_pid_n, k_tiles = tile_grid(num_pid_m, N, K, BLOCK_N, BLOCK_K)
    counter = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = tile_ids(tile, num_pid_m, num_pid_n, GROUP_M)
        for ki in range(k_tiles):
            s, phase = ring_slot(counter, NUM_STAGES)
            mbarrier.wait(empty.index(s), phase ^ 1)
            load_stage(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, ki * BLOCK_K, ready.index(s),
                       a_bufs.index(s), b_bufs.index(s), b_bufs.index(s), False)
            counter += 1


@gluon.jit
def _dense_consumer(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, NUM_PROGRAMS: gl.constexpr,
                    GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    layout: gl.constexpr = mma_layout(a_bufs.dtype, BLOCK_M, BLOCK_N, num_warps)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_tiles, num_pid_n, k_tiles = tile_grid(num_pid_m, N, K, BLOCK_N, BLOCK_K)
    counter = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = tile_ids(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
        acc, _, counter = mainloop(a_bufs, b_bufs, b_bufs, ready, empty, counter, k_tiles, acc, acc, NUM_STAGES,
                                   False)
        tma.store_wait(pendings=0)  # the previous tile's store has left c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma_store(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _gluon_dense_kernel(a_desc, b_desc, c_desc, M, N, K, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr,
                        NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    a_bufs, b_bufs, _, ready, empty = alloc_ring(a_desc, b_desc, NUM_STAGES, False)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    gl.warp_specialize([
        (_dense_consumer, (a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, NUM_PROGRAMS, GROUP_M, NUM_STAGES,
                           num_warps)),
        (_dense_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, NUM_PROGRAMS, GROUP_M, NUM_STAGES)),
    ], [1], [LOADER_REGS])


@functools.cache
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A Gluon TMA descriptor of 2-D ``t`` (last dim contiguous, 16-byte aligned rows) with an
    NVMMA-swizzled shared layout for ``block`` (built once per block and dtype)."""
    return TensorDescriptor.from_tensor(t, block, _shared_layout(tuple(block), t.dtype))


def max_registers(num_warps: int) -> int:
    """``maxnreg`` for a kernel of ``num_warps`` consumer warps plus the producer's warp group: the
    64K-register file shared so the producer keeps LOADER_REGS and the consumers the rest."""
    return min(65536 // ((num_warps + 4) * 32) // 8 * 8, 256)


def gluon_dense_matmul(a: torch.Tensor, b: torch.Tensor, config: GemmConfig, programs: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T``: ``a`` (M, K), ``b`` (N, K), bf16 or fp16, K contiguous, on an sm_90 GPU.
    ``config``: block_m/n/k, num_stages (the ring's depth), num_warps (4 or 8 consumer warps),
    group_m; ``programs``: persistent programs (the SM count). Returns (M, N) in ``a``'s dtype."""
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        raise ValueError(f"a and b must both be bf16 or fp16, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a (M, K) and b (N, K) must share K, got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    n = b.shape[0]
    c = out if out is not None else torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = min(programs, tiles)
    _gluon_dense_kernel[(programs, )](
        descriptor(a, [bm, bk]), descriptor(b, [bn, bk]), descriptor(c, [bm, bn]), m, n, k,
        NUM_PROGRAMS=programs, GROUP_M=config.group_m, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, maxnreg=max_registers(config.num_warps))
    return c
