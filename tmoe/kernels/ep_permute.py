"""Expert-parallel regroup: rows received per (source rank, local expert) <-> per-expert batches.

After the all-to-all, rank r holds ``(W, E_local, C, D)``: from each source rank s, for each
local expert l, ``counts[s, l] <= C`` valid rows. The experts want ``(E_local, W * C, D)`` with
each expert's rows packed from 0: segment (s, l) goes to rows ``offsets[s, l] ..`` of batch l,
``offsets[s, l] = sum_{s' < s} counts[s', l]``. ``to_batch=False`` is the inverse (the
expert outputs go back to their segments). Rows past a segment's count are not touched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels.checks import check_shape, check_tensor
from tmoe.kernels.sizes import cdiv, next_power_of_2
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _ep_permute_kernel(
    src_ptr,  # [W * E_local * C, D] segment layout (TO_BATCH) or batch layout, any dtype as bits
    dst_ptr,  # [W * E_local * C, D] the other layout
    counts_ptr,  # [W * E_local] int32 rows of segment (s, l), s major, in [0, C]
    offsets_ptr,  # [W * E_local] int32 first row of segment (s, l) within batch l
    D, capacity, num_local_experts, batch_rows,
    stride_src, stride_dst,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, TO_BATCH: tl.constexpr,
):
    seg = tl.program_id(0).to(tl.int64)
    pid_r = tl.program_id(1)
    local = seg % num_local_experts
    count = tl.load(counts_ptr + seg)
    offset = tl.load(offsets_ptr + seg).to(tl.int64)
    for r0 in range(pid_r * BLOCK_R, count, tl.num_programs(1) * BLOCK_R):
        rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR]
        mask_r = rows < count
        seg_rows = seg * capacity + rows
        batch_rows_ = local * batch_rows + offset + rows
        if TO_BATCH:
            src_rows, dst_rows = seg_rows, batch_rows_
        else:
            src_rows, dst_rows = batch_rows_, seg_rows
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask = mask_r[:, None] & (offs_d[None, :] < D)
            vals = tl.load(src_ptr + src_rows[:, None] * stride_src + offs_d[None, :], mask=mask)  # [BR, BD]
            tl.store(dst_ptr + dst_rows[:, None] * stride_dst + offs_d[None, :], vals, mask=mask)


@with_interpreter_fixes
def ep_permute(
    src: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor, *, num_local_experts: int, capacity: int,
    to_batch: bool, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Move the valid rows of ``src`` between the segment and the batch layout (module docstring).

    Args:
        src: (W * E_local * C, D) any dtype, last dim contiguous.
        counts: (W * E_local,) int32, source-rank major, each in [0, C] (clamp received counts).
        offsets: (W * E_local,) int32 exclusive prefix sums of ``counts`` over source ranks.
        num_local_experts: E_local; capacity: C.
        to_batch: True segment -> batch, False batch -> segment.
        out: optional output shaped like ``src`` (rows it does not receive keep their contents).

    Returns:
        ``out`` (or a new tensor shaped like ``src``) with the rows moved.
    """
    segments = counts.shape[0] if counts.dim() == 1 else -1
    check_tensor("counts", counts, dtypes=(torch.int32,), ndim=1, device=src.device, contiguous=True)
    check_tensor("offsets", offsets, dtypes=(torch.int32,), ndim=1, device=src.device, contiguous=True)
    check_shape("offsets", offsets, (segments,))
    if segments % num_local_experts:
        raise ValueError(f"counts has {segments} segments, not a multiple of num_local_experts={num_local_experts}")
    check_tensor("src", src, ndim=2)
    check_shape("src", src, (segments * capacity, src.shape[1]))
    if src.shape[1] > 1 and src.stride(1) != 1:
        raise ValueError("src must be contiguous along its last dimension")
    if out is None:
        out = torch.empty_like(src)
    check_shape("out", out, tuple(src.shape))
    if src.numel() == 0:
        return out
    bits = _BITS[src.element_size()]
    s, o = src.view(bits), out.view(bits)
    d = s.shape[1]
    block_r = 16
    world = segments // num_local_experts
    grid = (segments, max(1, min(cdiv(capacity, block_r), 64)))
    launch(
        _ep_permute_kernel, grid, s, o, counts, offsets, D=d, capacity=capacity, num_local_experts=num_local_experts,
        batch_rows=world * capacity, stride_src=s.stride(0), stride_dst=o.stride(0),
        BLOCK_R=block_r, BLOCK_D=min(512, next_power_of_2(max(d, 16))), TO_BATCH=to_batch,
    )
    return out
