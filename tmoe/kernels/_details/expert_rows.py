"""Jit helpers of the K-grouped backward kernels (``moe_grad_weight``, ``moe_grad_bias``): an
expert's run of aligned rows, and one row block of it."""
import triton
import triton.language as tl


@triton.jit
def expert_rows(e, expert_map_ptr, expert_offsets_ptr, num_local_experts, HAS_MAP: tl.constexpr):
    """(local id int64, first row, end row) of global expert ``e``'s aligned rows; local -1 when
    another rank owns it (HAS_MAP, mapped outside [0, num_local_experts))."""
    local = e
    if HAS_MAP:
        local = tl.load(expert_map_ptr + e).to(tl.int64)
        local = tl.where((local < 0) | (local >= num_local_experts), -1, local)
    return local, tl.load(expert_offsets_ptr + e), tl.load(expert_offsets_ptr + e + 1)


@triton.jit
def row_block(r0, end, sorted_ids_ptr, num_slots, TOPK: tl.constexpr, BLOCK_R: tl.constexpr):
    """(aligned rows, slots, valid, tokens) [BR] int64 of the row block at ``r0`` (rows at or past
    ``end`` and padding slots invalid, their token 0)."""
    rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
    slots = tl.load(sorted_ids_ptr + rows, mask=rows < end, other=num_slots).to(tl.int64)
    valid = slots < num_slots
    return rows, slots, valid, tl.where(valid, slots // TOPK, 0)
