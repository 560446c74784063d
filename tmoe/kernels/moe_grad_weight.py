"""Weight gradients of the expert GEMMs: K-grouped GEMMs over each expert's aligned rows.

    dW[e] = sum over the rows r of expert e of  L[r].T @ R[r]      (P_DIM, Q_DIM)
    db[e] = sum over the same rows of L[r]                          (P_DIM), with a bias
One operand is a token tensor read through the slot's token (optionally times the slot's router
weight), the other a buffer of ``moe_grad_act`` in aligned-row order:
    dW2[e] (K, N)  = sum go[t_s].T (w_s a_s)     L = grad_out (tokens), R = inter (w a, aligned rows);
                                                 db2[e] = sum w_s go[t_s] (the bias sum weighted)
    dW1[e] (2N, K) = sum dh_s.T x[t_s]           L = grad_h, R = x (tokens; scaled when the
                                                 forward applied the router weight on the input)
One program owns one output tile of one expert and walks that expert's rows in order
(``expert_offsets`` of the align stage): fp32 accumulation, no atomics, deterministic. Programs
run expert by expert, each expert's tiles in grouped order, so its rows stay in L2 while its tiles
read them (expert-minor order re-read every row block once per output row block: GPT-OSS-20B's dW1
streamed about 17 GB). Rows of padding and of slots no local expert computed contribute exactly
zero. Where the rows fit TMA (``sorted_operands_fit``), the token operand is first copied into
aligned-row order (``sorted_rows``, padding rows zero) and both operands load as whole row blocks by
TMA descriptors (``_moe_grad_weight_tma_kernel``: no gathers, no masks, the pointer kernel's
gathered, transposed left tile kept its MMAs waiting on each step). db is its own memory-bound
kernel over the same rows (``tmoe.kernels.moe_grad_bias``; summed inside the GEMM, its register
reduction of the left tile kept that operand out of the async-copy pipeline: GPT-OSS-20B's dW1 and
dW2 ran 2.7x slower with it), so trainable biases of frozen weights cost no weight GEMM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tmoe.kernels._details.expert_rows import expert_rows, row_block
from tmoe.kernels._details.tile_matmul import tile_ids
from tmoe.kernels.gemm_args import tma_addressable
from tmoe.kernels.grad_config import WeightTiles
from tmoe.kernels.operands import Routing
from tmoe.kernels.sizes import backward_stages, cdiv
from tmoe.kernels.sorted_rows import aligned_copy
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch


@triton.jit
def _weight_tile(expert_offsets_ptr, expert_map_ptr, P_DIM, Q_DIM, num_local_experts, BLOCK_P: tl.constexpr,
                 BLOCK_Q: tl.constexpr, GROUP_P: tl.constexpr, HAS_MAP: tl.constexpr):
    """(local expert (-1 remote), first row, end row, pid_p, pid_q) of this program: experts in
    order, each expert's output tiles in grouped order (``GROUP_P`` row blocks sweep the columns)."""
    num_pid_p = tl.cdiv(P_DIM, BLOCK_P)
    num_pid_q = tl.cdiv(Q_DIM, BLOCK_Q)
    e = (tl.program_id(0) // (num_pid_p * num_pid_q)).to(tl.int64)
    pid_p, pid_q = tile_ids(tl.program_id(0) % (num_pid_p * num_pid_q), num_pid_p, num_pid_q, GROUP_P)
    local, start, end = expert_rows(e, expert_map_ptr, expert_offsets_ptr, num_local_experts, HAS_MAP)
    return local, start, end, pid_p, pid_q


@triton.jit
def _store_weight_tile(acc, out_ptr, local, pid_p, pid_q, P_DIM, Q_DIM, stride_oe, stride_op, stride_oq,
                       BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Write the [BP, BQ] float32 tile ``acc`` of local expert ``local``'s dW in out's dtype."""
    offs_p = pid_p.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
    offs_q = pid_q.to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BQ]
    tl.store(out_ptr + local * stride_oe + offs_p[:, None] * stride_op + offs_q[None, :] * stride_oq,
             acc.to(out_ptr.dtype.element_ty), mask=(offs_p < P_DIM)[:, None] & (offs_q < Q_DIM)[None, :])


@triton.jit(do_not_specialize=['num_slots'])
def _moe_grad_weight_kernel(
    left_ptr,  # TOKENS_LEFT: [M, P_DIM] token rows, else [P, P_DIM] aligned rows
    right_ptr,  # TOKENS_LEFT: [P, Q_DIM] aligned rows, else [M, Q_DIM] token rows
    topk_weights_ptr,  # [num_slots] float32 (SCALE_TOKENS)
    sorted_ids_ptr,  # [P] int32
    expert_offsets_ptr,  # [E + 1] int32: expert e's aligned rows are [offsets[e], offsets[e + 1])
    expert_map_ptr,  # [E] int32 (HAS_MAP)
    out_ptr,  # [E_local, P_DIM, Q_DIM]
    num_slots, P_DIM, Q_DIM, num_local_experts,
    stride_lm, stride_lk, stride_rm, stride_rk, stride_oe, stride_op, stride_oq,
    TOPK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    TOKENS_LEFT: tl.constexpr, SCALE_TOKENS: tl.constexpr, HAS_MAP: tl.constexpr, PRECISION: tl.constexpr,
    GROUP_P: tl.constexpr,
):
    local, start, end, pid_p, pid_q = _weight_tile(expert_offsets_ptr, expert_map_ptr, P_DIM, Q_DIM, num_local_experts,
                                                   BLOCK_P, BLOCK_Q, GROUP_P, HAS_MAP)
    if local < 0:  # remote: another rank owns its gradient
        return
    offs_p = pid_p.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
    offs_q = pid_q.to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BQ]
    mask_p = offs_p < P_DIM
    mask_q = offs_q < Q_DIM
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows, slots, valid, tokens = row_block(r0, end, sorted_ids_ptr, num_slots, TOPK, BLOCK_R)  # [BR]
        if TOKENS_LEFT:
            l_rows, r_rows = tokens, rows
        else:
            l_rows, r_rows = rows, tokens
        lt = tl.load(left_ptr + l_rows[:, None] * stride_lm + offs_p[None, :] * stride_lk,
                     mask=valid[:, None] & mask_p[None, :], other=0.0)  # [BR, BP]
        rt = tl.load(right_ptr + r_rows[:, None] * stride_rm + offs_q[None, :] * stride_rk,
                     mask=valid[:, None] & mask_q[None, :], other=0.0)  # [BR, BQ]
        if SCALE_TOKENS:
            w = tl.load(topk_weights_ptr + slots, mask=valid, other=0.0)[:, None]  # [BR, 1]
            if TOKENS_LEFT:
                lt = (lt.to(tl.float32) * w).to(left_ptr.dtype.element_ty)
            else:
                rt = (rt.to(tl.float32) * w).to(right_ptr.dtype.element_ty)
        acc = tl.dot(tl.trans(lt), rt, acc, input_precision=PRECISION)  # [BP, BQ]
    _store_weight_tile(acc, out_ptr, local, pid_p, pid_q, P_DIM, Q_DIM, stride_oe, stride_op, stride_oq, BLOCK_P,
                       BLOCK_Q)


@triton.jit
def _moe_grad_weight_tma_kernel(
    left_desc,  # [P, P_DIM] TMA descriptor, block [BLOCK_R, BLOCK_P]: aligned rows, padding rows zero
    right_desc,  # [P, Q_DIM] TMA descriptor, block [BLOCK_R, BLOCK_Q]: aligned rows, padding rows zero
    expert_offsets_ptr,  # [E + 1] int32, each a multiple of BLOCK_R
    expert_map_ptr,  # [E] int32 (HAS_MAP)
    out_ptr,  # [E_local, P_DIM, Q_DIM]
    P_DIM, Q_DIM, num_local_experts, stride_oe, stride_op, stride_oq,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, HAS_MAP: tl.constexpr,
    PRECISION: tl.constexpr, GROUP_P: tl.constexpr,
):
    """``_moe_grad_weight_kernel`` with both operands in aligned-row order (the token operand
    copied there by ``sorted_rows``), each row block loaded whole by TMA: no masks, no gathers,
    padding rows (zeros) summed in. Same tile order, same row-block order."""
    local, start, end, pid_p, pid_q = _weight_tile(expert_offsets_ptr, expert_map_ptr, P_DIM, Q_DIM, num_local_experts,
                                                   BLOCK_P, BLOCK_Q, GROUP_P, HAS_MAP)
    if local < 0:  # remote: another rank owns its gradient
        return
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        lt = left_desc.load([r0, pid_p * BLOCK_P])  # [BR, BP]
        rt = right_desc.load([r0, pid_q * BLOCK_Q])  # [BR, BQ]
        acc = tl.dot(lt.T, rt, acc, input_precision=PRECISION)  # [BP, BQ]
    _store_weight_tile(acc, out_ptr, local, pid_p, pid_q, P_DIM, Q_DIM, stride_oe, stride_op, stride_oq, BLOCK_P,
                       BLOCK_Q)


def sorted_operands_fit(left: torch.Tensor, right: torch.Tensor, row_align: int, tiles: WeightTiles) -> bool:
    """Whether ``moe_grad_weight`` runs on TMA: ``tiles.tma``, rows of 16-byte multiples in both
    operands (the aligned-row one TMA-addressable as it is), and expert runs (multiples of
    ``row_align``) that whole row blocks of ``tiles.block_r`` tile exactly."""
    return (tiles.tma and row_align % tiles.block_r == 0
            and all(t.shape[1] * t.element_size() % 16 == 0 for t in (left, right)))


@with_interpreter_fixes
def moe_grad_weight(
    left: torch.Tensor, right: torch.Tensor, topk_weights: torch.Tensor, sorted_ids: torch.Tensor,
    expert_offsets: torch.Tensor, num_local_experts: int, *, tokens_left: bool, scale_tokens: bool,
    row_align: int, tiles: WeightTiles, expert_map: torch.Tensor | None = None, transposed: bool = False,
) -> torch.Tensor:
    """dW (E_local, P_DIM, Q_DIM) in ``left``'s dtype.

    Args:
        left: (rows, P_DIM), right: (rows, Q_DIM): one of them (``tokens_left``: left) a token
            tensor (M, ·) read at each slot's token, the other an aligned-row buffer (P, ·) whose
            padding rows are zero.
        topk_weights: (M, topk) float32, contiguous; multiplies the token operand's rows when
            ``scale_tokens``.
        sorted_ids: (P,) int32 and expert_offsets: (E + 1,) int32, from ``moe_align_block_size``
            at block size ``row_align`` (every offset a multiple of it).
        num_local_experts: E_local; expert_map: optional (E,) int32 global -> local id (-1 remote).
        transposed: dW in the layout of a weight stored transposed, (E_local, Q_DIM, P_DIM) in memory
            and returned as its (E_local, P_DIM, Q_DIM) view, so autograd hands it to the parameter
            without a transposing copy.
        tiles: the tiles, and whether to take the TMA path where it fits (the rule:
            ``tmoe.config.backward.weight_tiles``).

    On the TMA path a (P, ·) workspace holds the token operand in aligned-row order (times the
    router weights when ``scale_tokens``) while the GEMM runs.
    """
    p_dim, q_dim = left.shape[1], right.shape[1]
    num_experts = expert_offsets.shape[0] - 1
    make = torch.zeros if expert_map is not None else torch.empty  # a map may leave local experts unvisited
    if transposed:
        grad_w = make((num_local_experts, q_dim, p_dim), dtype=left.dtype, device=left.device).transpose(1, 2)
    else:
        grad_w = make((num_local_experts, p_dim, q_dim), dtype=left.dtype, device=left.device)
    if num_local_experts == 0 or p_dim == 0 or q_dim == 0:
        return grad_w
    fp32 = left.dtype == torch.float32
    grid = (num_experts * cdiv(p_dim, tiles.block_p) * cdiv(q_dim, tiles.block_q),)
    common = dict(expert_offsets_ptr=expert_offsets,
                  expert_map_ptr=expert_map if expert_map is not None else expert_offsets, out_ptr=grad_w,
                  P_DIM=p_dim, Q_DIM=q_dim, num_local_experts=num_local_experts,
                  stride_oe=grad_w.stride(0), stride_op=grad_w.stride(1), stride_oq=grad_w.stride(2),
                  BLOCK_P=tiles.block_p, BLOCK_Q=tiles.block_q, BLOCK_R=tiles.block_r, HAS_MAP=expert_map is not None,
                  PRECISION="ieee" if fp32 else "tf32", GROUP_P=tiles.group_p, num_warps=tiles.num_warps,
                  num_stages=backward_stages(tiles.num_stages, fp32))
    aligned = right if tokens_left else left
    if sorted_ids.shape[0] and sorted_operands_fit(left, right, row_align, tiles) and tma_addressable(aligned):
        # the copy reads no expert ids; expert_offsets[E] is the padded row count, the rows the GEMM reads
        routing = Routing(sorted_ids, expert_offsets, expert_offsets[-1:], topk_weights.numel(), topk_weights.shape[1])
        tokens = aligned_copy(left if tokens_left else right, routing, topk_weights if scale_tokens else None)
        left, right = (tokens, right) if tokens_left else (left, tokens)
        launch(_moe_grad_weight_tma_kernel, grid,
               left_desc=TensorDescriptor.from_tensor(left, [tiles.block_r, tiles.block_p]),
               right_desc=TensorDescriptor.from_tensor(right, [tiles.block_r, tiles.block_q]), **common)
        return grad_w
    launch(_moe_grad_weight_kernel, grid,
           left_ptr=left, right_ptr=right, topk_weights_ptr=topk_weights, sorted_ids_ptr=sorted_ids,
           num_slots=topk_weights.numel(), stride_lm=left.stride(0), stride_lk=left.stride(1),
           stride_rm=right.stride(0), stride_rk=right.stride(1), TOPK=topk_weights.shape[1], TOKENS_LEFT=tokens_left,
           SCALE_TOKENS=scale_tokens, **common)
    return grad_w
