"""Sort-and-align: group token slots by expert, pad each expert's run to the GEMM block size.

Deterministic and stable: within an expert, slots keep ascending slot order. No atomics.
Small problems (one chunk) take one launch; larger ones three: per-chunk histogram, a
one-program scan that turns counts into positions, and a per-chunk scatter. A chunk is a few
sub-tiles, so the serial part of each program stays short and large inputs spread over
many programs. Up to ``SORT_MAX_SLOTS`` slots, problems past one chunk can instead take one
launch that sorts (expert, slot) keys in one program (no serial sub-tile steps); the outputs are
identical.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels._details.align_layout import (
    chunk_counts, expert_counts, padded_runs, scatter_chunk, slot_experts, write_layout,
)
from tmoe.kernels.checks import INDEX_DTYPES, check_tensor
from tmoe.kernels.sizes import cdiv, check_num_local_experts, next_power_of_2
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch
from tmoe.runtime.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from tmoe.runtime.plan import Launch, planned

MAX_CHUNK = 1024
SUB_TILE_ELEMENTS = 4096  # a scatter sub-tile is [SUB, E_PAD]: SUB = 4096 // E_PAD slots
# A chunk is at least this many sub-tiles, which each program walks in sequence (each step depends
# on the last); past TARGET_CHUNKS * that many slots it grows (powers of two, up to MAX_CHUNK) so
# that about TARGET_CHUNKS programs count and scatter and the one-program scan stays short
# (docs/routes.md). Read when a call signature is first planned: after changing them,
# ``tmoe.runtime.state.clear_launch_caches()``.
SUBS_PER_CHUNK = 4
TARGET_CHUNKS = 128
# Slots past one chunk up to which one sorting program replaces the three launches (faster up to
# 1024 slots, slower at 2048: docs/routes.md). Read when a call signature is first planned: after
# changing it, ``tmoe.runtime.state.clear_launch_caches()``.
SORT_MAX_SLOTS = 1024
SORT_SLOT_LIMIT = 4096  # the sorting program holds every slot's key in registers: at most this many
# The scan is one program, each step a dependent [CT, E_PAD] load of the chunk counts: 4 warps over
# 4096 counts a step (16 warps over 8192 took 1.2-1.9x as long on H100 at every measured shape)
SCAN_TILE_ELEMENTS, SCAN_WARPS = 4096, 4


@triton.jit(do_not_specialize=['numel', 'max_padded', 'num_blocks'])
def _align_single_kernel(
    topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, expert_map_ptr, offsets_ptr,
    numel, num_experts, num_local_experts, max_padded, num_blocks,
    BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr,
    HAS_MAP: tl.constexpr, HAS_OFFSETS: tl.constexpr, TILE: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    totals = chunk_counts(topk_ids_ptr, 0, numel, num_experts, CHUNK, E_PAD)
    pdl_launch_dependents(USE_PDL)  # one program: the next kernel's programs take no slot it needs
    starts, ends = padded_runs(totals, BLOCK_SIZE)
    write_layout(starts, totals, ends, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, expert_map_ptr,
                  offsets_ptr, numel, num_experts, num_local_experts, max_padded, num_blocks, BLOCK_SIZE, E_PAD,
                  HAS_MAP, HAS_OFFSETS, TILE)
    scatter_chunk(topk_ids_ptr, sorted_ids_ptr, 0, starts, numel, num_experts, CHUNK, SUB, E_PAD)


@triton.jit(do_not_specialize=['numel', 'max_padded', 'num_blocks'])
def _align_sort_kernel(
    topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, expert_map_ptr, offsets_ptr,
    numel, num_experts, num_local_experts, max_padded, num_blocks,
    BLOCK_SIZE: tl.constexpr, NUMEL_PAD: tl.constexpr, SLOT_BITS: tl.constexpr, E_PAD: tl.constexpr,
    HAS_MAP: tl.constexpr, HAS_OFFSETS: tl.constexpr, TILE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program: every slot at once. Sorting the keys expert << SLOT_BITS | slot groups the
    slots by expert in ascending slot order (out-of-range ids get expert E_PAD: last, not stored);
    the slot at sorted index j of expert e goes to starts[e] + j - (valid slots of experts < e)."""
    pdl_wait(USE_PDL)
    slots = tl.arange(0, NUMEL_PAD)
    ids, valid = slot_experts(topk_ids_ptr, slots, numel, num_experts)
    totals = expert_counts(ids, valid, E_PAD)
    pdl_launch_dependents(USE_PDL)  # one program: the next kernel's programs take no slot it needs
    starts, ends = padded_runs(totals, BLOCK_SIZE)
    write_layout(starts, totals, ends, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, expert_map_ptr,
                  offsets_ptr, numel, num_experts, num_local_experts, max_padded, num_blocks, BLOCK_SIZE, E_PAD,
                  HAS_MAP, HAS_OFFSETS, TILE)
    keys = tl.sort((tl.where(valid, ids, E_PAD).to(tl.int32) << SLOT_BITS) | slots)  # [NUMEL_PAD]
    expert = keys >> SLOT_BITS
    shift = starts - (tl.cumsum(totals, axis=0) - totals)  # [E_PAD]: first position minus earlier slots
    pos = slots + tl.gather(shift, tl.minimum(expert, E_PAD - 1), 0)
    tl.store(sorted_ids_ptr + pos, keys & ((1 << SLOT_BITS) - 1), mask=expert < E_PAD)


@triton.jit(do_not_specialize=['numel'])
def _align_count_kernel(topk_ids_ptr, counts_ptr, numel, num_experts, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    counts = chunk_counts(topk_ids_ptr, pid * CHUNK, numel, num_experts, CHUNK, E_PAD)
    pdl_launch_dependents(USE_PDL)
    tl.store(counts_ptr + pid * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit(do_not_specialize=['num_chunks', 'numel', 'max_padded', 'num_blocks'])
def _align_scan_kernel(
    counts_ptr,  # [num_chunks, E_PAD] int32: in, per-chunk counts; out, per-chunk base positions
    sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, expert_map_ptr, offsets_ptr,
    num_chunks, numel, num_experts, num_local_experts, max_padded, num_blocks,
    BLOCK_SIZE: tl.constexpr, E_PAD: tl.constexpr, CT: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, TILE: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    offs_e = tl.arange(0, E_PAD)
    totals = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, num_chunks, CT):
        offs_c = c0 + tl.arange(0, CT)
        ptrs = counts_ptr + offs_c[:, None] * E_PAD + offs_e[None, :]
        totals += tl.sum(tl.load(ptrs, mask=offs_c[:, None] < num_chunks, other=0), axis=0)
    starts, ends = padded_runs(totals, BLOCK_SIZE)
    run = starts
    for c0 in range(0, num_chunks, CT):
        offs_c = c0 + tl.arange(0, CT)
        ptrs = counts_ptr + offs_c[:, None] * E_PAD + offs_e[None, :]
        mask = offs_c[:, None] < num_chunks
        counts = tl.load(ptrs, mask=mask, other=0)  # [CT, E_PAD]
        tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + run[None, :], mask=mask)
        run += tl.sum(counts, axis=0)
    pdl_launch_dependents(USE_PDL)
    write_layout(starts, totals, ends, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, expert_map_ptr,
                  offsets_ptr, numel, num_experts, num_local_experts, max_padded, num_blocks, BLOCK_SIZE, E_PAD,
                  HAS_MAP, HAS_OFFSETS, TILE)


@triton.jit(do_not_specialize=['numel'])
def _align_scatter_kernel(
    topk_ids_ptr, sorted_ids_ptr, base_ptr, numel, num_experts,
    CHUNK: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    base = tl.load(base_ptr + pid * E_PAD + tl.arange(0, E_PAD))
    scatter_chunk(topk_ids_ptr, sorted_ids_ptr, pid * CHUNK, base, numel, num_experts, CHUNK, SUB, E_PAD)
    pdl_launch_dependents(USE_PDL)  # at the end: the chunk's loads and stores interleave


def align_output_sizes(numel: int, block_size: int, num_experts: int) -> tuple[int, int]:
    """(len(sorted_token_ids), len(expert_ids)) for ``numel`` slots: static, worst case."""
    # sym_min, not a branch: on a symbolic numel (torch.compile's fake) a comparison would guard
    # and recompile when numel crosses num_experts
    max_padded = torch.sym_min(numel + num_experts * (block_size - 1), numel * block_size)
    return max_padded, cdiv(max_padded, block_size)


@with_interpreter_fixes
def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_map: torch.Tensor | None = None,
    expert_offsets: torch.Tensor | None = None, *, num_local_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the ``topk_ids.numel()`` slots by expert, each run padded to ``block_size``.

    Args:
        topk_ids: (M, topk) int32/int64, contiguous. Ids outside [0, num_experts) are skipped.
        block_size: the GEMM's BLOCK_M (a power of two).
        num_experts: global expert count E.
        expert_map: optional (E,) int32, global id -> local id; maps ``expert_ids``, where a value
            outside [0, num_local_experts) becomes -1 (remote: the GEMMs write zeros).
        expert_offsets: optional (E + 1,) int32 output: each expert's first position in
            ``sorted_token_ids``, then the padded length.
        num_local_experts: the local expert count with ``expert_map`` (None: ``num_experts``, vLLM's
            contract; mapped ids at or past the true count are then not caught).

    Returns:
        sorted_token_ids (int32, ``numel + E*(block_size-1)``, capped at ``numel*block_size``):
        slot indices grouped by expert in ascending order, padding = ``numel``;
        expert_ids (int32, one per block, -1 for remote experts; unused tail blocks 0);
        num_tokens_post_padded (int32, (1,)): sum over experts of round_up(count, block_size).

    Example:
        >>> sorted_ids, expert_ids, ntpp = moe_align_block_size(topk_ids, 16, 8)
    """
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, contiguous=True)
    if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts}")
    max_padded, num_blocks = align_output_sizes(topk_ids.numel(), block_size, num_experts)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_post_padded = torch.empty(1, dtype=torch.int32, device=dev)
    _align_into(topk_ids, block_size, num_experts, expert_map, expert_offsets, sorted_ids, expert_ids, num_post_padded,
                num_local_experts=num_local_experts)
    return sorted_ids, expert_ids, num_post_padded


@planned
def _align_into(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_map: torch.Tensor | None,
    expert_offsets: torch.Tensor | None, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_post_padded: torch.Tensor, *, num_local_experts: int | None,
) -> Launch | torch.Tensor:
    """``moe_align_block_size`` into its outputs: checks, then the launches (one kernel up to
    a chunk of slots, or up to ``SORT_MAX_SLOTS`` the sorting one: planned, once per signature;
    more: the count, scan and scatter kernels)."""
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, device=topk_ids.device, contiguous=True)
        if expert_map.shape[0] != num_experts:
            raise ValueError(f"expert_map must have num_experts={num_experts} entries, got {expert_map.shape[0]}")
    num_local_experts = check_num_local_experts(num_local_experts, expert_map, num_experts)
    if expert_offsets is not None:
        check_tensor("expert_offsets", expert_offsets, dtypes=(torch.int32,), ndim=1, device=topk_ids.device)
        if expert_offsets.shape[0] != num_experts + 1:
            raise ValueError(f"expert_offsets must have num_experts + 1 = {num_experts + 1} entries")
    numel = topk_ids.numel()
    max_padded, num_blocks = sorted_ids.shape[0], expert_ids.shape[0]
    dev = topk_ids.device
    e_pad = max(16, next_power_of_2(num_experts))
    meta = dict(E_PAD=e_pad, HAS_MAP=expert_map is not None, HAS_OFFSETS=expert_offsets is not None, TILE=64,
                BLOCK_SIZE=block_size)
    pdl = pdl_args()
    emap = expert_map if expert_map is not None else num_post_padded
    offsets = expert_offsets if expert_offsets is not None else num_post_padded
    sub = max(16, SUB_TILE_ELEMENTS // e_pad)
    chunk = min(MAX_CHUNK, max(sub * SUBS_PER_CHUNK, next_power_of_2(cdiv(numel, TARGET_CHUNKS))),
                max(16, next_power_of_2(numel)))
    sub = min(sub, chunk)
    if numel <= chunk:
        return Launch(_align_single_kernel, (1,), dict(
            topk_ids_ptr=topk_ids, sorted_ids_ptr=sorted_ids, expert_ids_ptr=expert_ids,
            num_post_padded_ptr=num_post_padded, expert_map_ptr=emap, offsets_ptr=offsets, numel=numel,
            num_experts=num_experts, num_local_experts=num_local_experts, max_padded=max_padded,
            num_blocks=num_blocks, CHUNK=chunk, SUB=sub, **meta, **pdl,
        ), sorted_ids)
    if numel <= min(SORT_MAX_SLOTS, SORT_SLOT_LIMIT):
        numel_pad = next_power_of_2(numel)
        return Launch(_align_sort_kernel, (1,), dict(
            topk_ids_ptr=topk_ids, sorted_ids_ptr=sorted_ids, expert_ids_ptr=expert_ids,
            num_post_padded_ptr=num_post_padded, expert_map_ptr=emap, offsets_ptr=offsets, numel=numel,
            num_experts=num_experts, num_local_experts=num_local_experts, max_padded=max_padded,
            num_blocks=num_blocks, NUMEL_PAD=numel_pad, SLOT_BITS=numel_pad.bit_length() - 1, num_warps=8,
            **meta, **pdl,
        ), sorted_ids)
    num_chunks = cdiv(numel, chunk)
    counts = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=dev)
    launch(_align_count_kernel, (num_chunks,), topk_ids, counts, numel, num_experts, CHUNK=chunk, E_PAD=e_pad, **pdl)
    launch(_align_scan_kernel, (1,),
        counts, sorted_ids, expert_ids, num_post_padded, emap, offsets, num_chunks, numel, num_experts,
        num_local_experts, max_padded, num_blocks, CT=max(1, SCAN_TILE_ELEMENTS // e_pad), num_warps=SCAN_WARPS,
        **meta, **pdl,
    )
    launch(_align_scatter_kernel, (num_chunks,),
        topk_ids, sorted_ids, counts, numel, num_experts, CHUNK=chunk, SUB=sub, E_PAD=e_pad, **pdl
    )
    return sorted_ids
