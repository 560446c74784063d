"""The warp-specialized Hopper GEMM engine (Gluon): a TMA producer warp feeds a ring of shared-memory
stages through mbarriers; the consumer warp groups (the default partition) issue ``warpgroup_mma``
with one MMA group in flight, free each stage as the MMA that read it retires, and run the epilogue
while the producer already streams the next tile's stages. One program per SM walks the tiles.

The pieces are shared by the dense matmul (``gluon_matmul``) and the grouped expert GEMMs
(``gluon_grouped``): a kernel supplies its tile walker (tile index -> A row, B rows) and its epilogue.
Everything here is sm_90 only (``warpgroup_mma``, TMA); the plan picks it where
``tmoe.runtime.gluon.gluon_ready`` holds, and the ``tl`` kernels elsewhere.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

# TMA copies: ``async_load``/``async_store`` from Triton 3.7 on, the older names in 3.6
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
LOADER_REGS = gl.constexpr(40)  # registers per thread of the one-warp TMA producer


@gluon.constexpr_function
def mma_layout(dtype, BLOCK_M, BLOCK_N, num_warps):
    """The wgmma accumulator layout of a [BLOCK_M, BLOCK_N] float32 tile of ``dtype`` operands over
    ``num_warps`` warps: warp groups stack along M (m64 per warp group for 128-row tiles over 8
    warps), the widest instruction N that divides BLOCK_N, K of 32 bytes."""
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if BLOCK_M > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    n = 256
    max_n = max(BLOCK_N // max(num_warps // max(BLOCK_M // 16, 1), 1), 8)
    while n > max_n or BLOCK_N % n != 0:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 256 // dtype.primitive_bitwidth])


@gluon.jit
def tile_ids(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of a persistent program's ``tile``-th output tile in grouped (swizzled) order:
    GROUP_M row blocks share each column sweep, so a weight tile is read once per group."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m


@gluon.jit
def tile_grid(num_pid_m, N, K, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """(output tiles, column blocks, K steps) of a GEMM of ``num_pid_m`` row blocks, N columns and
    depth K: what the producer and the consumers walk alike."""
    num_pid_n = gl.cdiv(N, BLOCK_N)
    return num_pid_m * num_pid_n, num_pid_n, gl.cdiv(K, BLOCK_K)


@gluon.jit
def ring_slot(counter, NUM_STAGES: gl.constexpr):
    """(stage, phase) of the ``counter``-th use of a NUM_STAGES ring."""
    return counter % NUM_STAGES, (counter // NUM_STAGES) & 1


@gluon.jit
def load_stage(a_desc, b_desc, a_row, b_row, b2_row, k, bar, a_buf, b_buf, b2_buf, TWO_B: gl.constexpr):
    """Issue one stage's TMA loads: A [BM, BK] at (a_row, k), B [BN, BK] at (b_row, k), and with
    TWO_B a second B tile at (b2_row, k) (the up GEMM's up rows beside its gate rows); ``bar``
    completes when all bytes have landed."""
    if TWO_B:
        mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
    else:
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [a_row, k], bar, a_buf)
    tma_load(b_desc, [b_row, k], bar, b_buf)
    if TWO_B:
        tma_load(b_desc, [b2_row, k], bar, b2_buf)


@gluon.jit
def mainloop(a_bufs, b_bufs, b2_bufs, ready, empty, counter, k_tiles, acc, acc2,
             NUM_STAGES: gl.constexpr, TWO_B: gl.constexpr, B_KN: gl.constexpr = False):
    """The consumer's K loop over ``k_tiles`` ring stages from ring position ``counter``: wait for a
    stage, issue its MMA(s) asynchronously, keep one MMA group in flight and free the stage the
    retired group read. B tiles are [BN, BK] (K-major, as W (N, K) stores them), or with B_KN
    [BK, BN] (N contiguous: a weight read along its rows, the input gradient's ``d @ w[e]``).
    Returns the accumulators (all MMAs retired) and the next ring position."""
    prev = 0
    for ki in range(k_tiles):
        s, phase = ring_slot(counter, NUM_STAGES)
        mbarrier.wait(ready.index(s), phase)
        if B_KN:
            b = b_bufs.index(s)
        else:
            b = b_bufs.index(s).permute((1, 0))  # [BK, BN] view of the K-major weight tile
        acc = warpgroup_mma(a_bufs.index(s), b, acc, use_acc=ki > 0, is_async=True)
        if TWO_B:
            acc2 = warpgroup_mma(a_bufs.index(s), b2_bufs.index(s).permute((1, 0)), acc2, use_acc=ki > 0,
                                 is_async=True)
            acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index(prev), pred=ki > 0)
        prev = s
        counter += 1
    if TWO_B:
        acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index(prev), pred=k_tiles > 0)
    return acc, acc2, counter


@gluon.jit
def alloc_ring(a_desc, b_desc, NUM_STAGES: gl.constexpr, TWO_B: gl.constexpr):
    """The shared-memory ring (A, B and with TWO_B a second B tile per stage) and its ready/empty
    mbarriers, initialized."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    if TWO_B:
        b2_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    else:
        b2_bufs = b_bufs
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return a_bufs, b_bufs, b2_bufs, ready, empty
