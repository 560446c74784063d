"""The align stage's jit building blocks: each slot's expert, per-expert counts, the padded runs,
one chunk's stable scatter, and the layout writes around the real slots (sentinels, block experts,
offsets)."""
import triton
import triton.language as tl


@triton.jit
def write_layout(
    starts, totals, ends,  # [E_PAD] int32: first position, slot count, end of the padded run
    sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, expert_map_ptr, offsets_ptr,
    numel, num_experts, num_local_experts, max_padded, num_blocks,
    BLOCK_SIZE: tl.constexpr, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    TILE: tl.constexpr,
):
    """Write everything but the real slots: the padded length, each block's expert (HAS_MAP: its
    local id, -1 when remote or outside [0, num_local_experts)), the sentinels, and (HAS_OFFSETS)
    each expert's first position, ``offsets[E]`` = the padded length."""
    total_padded = tl.sum(ends - starts, axis=0)
    tl.store(num_post_padded_ptr, total_padded)
    if HAS_OFFSETS:
        offs_e = tl.arange(0, E_PAD)
        tl.store(offsets_ptr + offs_e, starts, mask=offs_e < num_experts)
        tl.store(offsets_ptr + num_experts, total_padded)
    for b0 in range(0, num_blocks, TILE):
        offs_b = b0 + tl.arange(0, TILE)
        pos = offs_b * BLOCK_SIZE
        expert = tl.sum((ends[None, :] <= pos[:, None]).to(tl.int32), axis=1)  # [TILE]
        in_use = pos < total_padded
        if HAS_MAP:
            expert = tl.load(expert_map_ptr + expert, mask=in_use, other=0)
            expert = tl.where((expert >= 0) & (expert < num_local_experts), expert, -1)
        tl.store(expert_ids_ptr + offs_b, tl.where(in_use, expert, 0), mask=offs_b < num_blocks)
    for j0 in range(0, BLOCK_SIZE, TILE):
        pos = (starts + totals)[:, None] + (j0 + tl.arange(0, TILE))[None, :]  # [E_PAD, TILE]
        tl.store(sorted_ids_ptr + pos, numel, mask=pos < ends[:, None])
    TAIL: tl.constexpr = 16 * TILE  # the unused tail is up to E * (BLOCK_SIZE - 1) long: wide steps
    for p0 in range(total_padded, max_padded, TAIL):
        offs = p0 + tl.arange(0, TAIL)
        tl.store(sorted_ids_ptr + offs, numel, mask=offs < max_padded)


@triton.jit
def slot_experts(topk_ids_ptr, offs, numel, num_experts):
    """(expert ids, valid) of slots ``offs``: slots past numel read -1; valid: an id in [0, num_experts)."""
    ids = tl.load(topk_ids_ptr + offs, mask=offs < numel, other=-1)
    return ids, (ids >= 0) & (ids < num_experts)


@triton.jit
def expert_counts(ids, valid, E_PAD: tl.constexpr):
    """[E_PAD] int32: the valid slots of each expert."""
    return tl.histogram(tl.where(valid, ids, 0).to(tl.int32), E_PAD, mask=valid)


@triton.jit
def chunk_counts(topk_ids_ptr, chunk_start, numel, num_experts, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    ids, valid = slot_experts(topk_ids_ptr, chunk_start + tl.arange(0, CHUNK), numel, num_experts)
    return expert_counts(ids, valid, E_PAD)


@triton.jit
def scatter_chunk(
    topk_ids_ptr, sorted_ids_ptr, chunk_start, base,  # base [E_PAD]: position of the chunk's first slot per expert
    numel, num_experts, CHUNK: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr,
):
    offs_e = tl.arange(0, E_PAD)
    run = base
    for s in range(0, CHUNK, SUB):
        offs = chunk_start + s + tl.arange(0, SUB)
        ids, valid = slot_experts(topk_ids_ptr, offs, numel, num_experts)
        onehot = (ids[:, None] == offs_e[None, :]) & valid[:, None]  # [SUB, E_PAD]
        count = onehot.to(tl.int32)
        rank = tl.cumsum(count, axis=0) - 1 + run[None, :]
        pos = tl.sum(tl.where(onehot, rank, 0), axis=1)  # [SUB]
        tl.store(sorted_ids_ptr + pos, offs.to(tl.int32), mask=valid)
        run += tl.sum(count, axis=0)


@triton.jit
def padded_runs(totals, BLOCK_SIZE: tl.constexpr):
    padded = tl.cdiv(totals, BLOCK_SIZE) * BLOCK_SIZE
    ends = tl.cumsum(padded, axis=0)
    return ends - padded, ends
