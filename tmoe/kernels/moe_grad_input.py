"""Backward of an expert GEMM to its input, and the router weights' gradients.

Per aligned row block of expert e and BLOCK_N output columns (one output tile):
    da_s = d_s @ w[e]          an M-grouped GEMM with w (E, R, C) read as stored (no transposed copy)
``moe_grad_input`` runs it on the up GEMM (d = dh (P, 2N), w = w1, da = dx (K)): written per slot,
then summed over each token's top-k slots in a fixed order by the reduce stage
(``tmoe.kernels.reduce.moe_reduce``; apply_router_weight_on_input multiplies by the router weight
there); the tiles of the first column block also sum each row's partial router-weight
gradients (``moe_grad_act``) in a fixed order. ``sorted_input_grad`` runs it on the down GEMM
(d = grad_out's rows in aligned order, w = w2, da (P, N) in aligned order: ``moe_grad_act``'s
``g_first`` path). No atomics: deterministic. As on the forward's grouped core
(``moe_grouped_gemm``), at most one program per SM walks the valid tiles (their count read from
num_post_padded) in grouped order (``sizes.row_group`` row blocks sweep the column blocks together,
so each row block's dh is read from memory about once, not once per column block). Where TMA can
address dh and w1 (float w1 with K contiguous; ``InputTiles.tma``), both load by TMA descriptors
through the core's tile matmul (``moe_tile_matmul_tma``, w read as stored): dh's rows are one
expert's aligned block, w1's a [BLOCK_R, BLOCK_N] box of the expert (rows past 2N read zero), and
the tile loop is flattened (the next tile's loads issue during this tile's epilogue) unless an
expert map may mark blocks remote; else by pointers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tmoe.kernels._details.common import dequant_block
from tmoe.kernels._details.dequant_gather import dequant_gather
from tmoe.kernels._details.lora_dot import lora_term
from tmoe.kernels._details.tile_matmul import moe_tile_matmul_tma, tile_ids
from tmoe.kernels.gemm_args import tma_addressable
from tmoe.kernels.grad_config import InputTiles
from tmoe.kernels.lora import LoraOperands, padded_rank
from tmoe.kernels.operands import BlockScales, WeightScales, logical_cols, scale_strides
from tmoe.kernels.sizes import backward_stages, cdiv, row_group
from tmoe.kernels.gemm_config import GemmConfig
from tmoe.runtime.device import persistent_programs, sm_count
from tmoe.runtime.gluon import gluon_ready
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch
from tmoe.kernels.reduce import moe_reduce

try:  # the warp-specialized engine; where this Triton's Gluon API differs, the tl kernel runs everywhere
    from tmoe.kernels import gluon_grad_input
except (ImportError, AttributeError, TypeError):
    gluon_grad_input = None

PARTS_BLOCK = 16


@triton.jit(do_not_specialize=['num_slots'])
def _moe_grad_input_kernel(
    grad_h_src,  # [P, W1_ROWS] aligned rows (TMA: its descriptor, block [BLOCK_M, BLOCK_R])
    w1_src,  # [E, W1_ROWS, K] (TMA: its descriptor, block [1, BLOCK_R, BLOCK_N])
    partial_ptr,  # [P, num_parts] float32 (ROUTER_GRAD)
    sorted_ids_ptr,  # [P] int32
    expert_ids_ptr,  # [P // BLOCK_M] int32, -1 remote
    num_post_padded_ptr,  # [1] int32
    grad_slots_ptr,  # [num_slots, K] out (SORTED_OUT: [P, K], aligned rows)
    grad_weights_ptr,  # [num_slots] float32 out, zero-filled by the launcher (ROUTER_GRAD)
    s1_ptr,  # [E, cdiv(W1_ROWS, SCALE_R), cdiv(K, SCALE_C)] float32 (FP8_W: w1 = q * s); W_QUANT: group scales
    lora_u_ptr,  # LORA: [P or num_slots (LORA_SLOT_ROWS), rank] each row's u = d @ B[e]
    lora_l_ptr,  # LORA: [E, K, rank] (A[e], transposed): the epilogue adds lora_scale * u @ A[e]
    lora_rank, stride_lum, stride_lle, stride_llk, stride_llr, lora_scale,
    num_slots, W1_ROWS, K, num_parts,
    stride_hm, stride_w1e, stride_w1r, stride_w1k, stride_sm, stride_pm, stride_s1e, stride_s1r, stride_s1c,
    zp_ptr,  # W_QUANT with HAS_ZP: zero points [E, W1_ROWS (int4: / 2), K // GROUP_K] uint8
    stride_zpe, stride_zpr, stride_zpc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PARTS_BLOCK: tl.constexpr,
    PRECISION: tl.constexpr, FP8_W: tl.constexpr, SCALE_R: tl.constexpr, SCALE_C: tl.constexpr,
    GROUP_M: tl.constexpr, TMA: tl.constexpr, ROUTER_GRAD: tl.constexpr, SORTED_OUT: tl.constexpr,
    SKIP_REMOTE: tl.constexpr, NUM_PROGRAMS: tl.constexpr, LORA: tl.constexpr, LORA_R: tl.constexpr,
    LORA_SLOT_ROWS: tl.constexpr, EXPERT_BLOCK: tl.constexpr, W_QUANT: tl.constexpr, GROUP_K: tl.constexpr,
    HAS_ZP: tl.constexpr,
):
    num_pid_n = tl.cdiv(K, BLOCK_N)
    num_valid_m = tl.load(num_post_padded_ptr) // BLOCK_M
    for tile in tl.range(tl.program_id(0), num_valid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = tile_ids(tile, num_valid_m, num_pid_n, GROUP_M)
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        slots = tl.load(sorted_ids_ptr + rows).to(tl.int64)
        mask_m = slots < num_slots
        if ROUTER_GRAD:
            if pid_n == 0:  # the router weights' gradient: the row's partials, in column-block order
                acc_w = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for c0 in range(0, num_parts, PARTS_BLOCK):
                    offs_c = c0 + tl.arange(0, PARTS_BLOCK)
                    part = tl.load(partial_ptr + rows[:, None] * stride_pm + offs_c[None, :],
                                   mask=offs_c[None, :] < num_parts, other=0.0)  # [BM, PB]
                    acc_w += tl.sum(part, axis=1)
                tl.store(grad_weights_ptr + slots, acc_w, mask=mask_m)
        expert = tl.load(expert_ids_ptr + (pid_m * BLOCK_M) // EXPERT_BLOCK)  # a tile may be part of an align block
        local = expert >= 0  # remote blocks (-1): the reduce never reads their slots
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of K
        mask_n = offs_n < K
        if TMA:
            # A uniform K loop lets the tile loop flatten (the next tile's loads issue during this
            # one's epilogue); a remote block then reads zeros (TMA past the experts) and stores nothing
            if SKIP_REMOTE:
                k_end = tl.where(local, W1_ROWS, 0)
            else:
                k_end = W1_ROWS
            every_row = tl.full((BLOCK_M,), 1, tl.int1)
            acc, _ = moe_tile_matmul_tma(
                grad_h_src, w1_src, pid_m * BLOCK_M, every_row, expert, pid_n * BLOCK_N, 0, W1_ROWS,
                partial_ptr, partial_ptr, k_end, 0, 0, 0, 0, BLOCK_M, BLOCK_N, BLOCK_R, 1, 1, "none", False, False,
                True, PRECISION, A_DESC=True, W_KN=True,
            )  # [BM, BN] float32
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_base = w1_src + expert.to(tl.int64) * stride_w1e  # read only where local
            s_base = s1_ptr + expert.to(tl.int64) * stride_s1e
            for r0 in range(0, tl.where(local, W1_ROWS, 0), BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)  # [BR]
                mask_r = offs_r < W1_ROWS
                dh = tl.load(grad_h_src + rows[:, None] * stride_hm + offs_r[None, :], mask=mask_r[None, :],
                             other=0.0)  # [BM, BR]
                mask_w = mask_r[:, None] & mask_n[None, :]
                if W_QUANT != "none":  # frozen low-bit w, its codes dequantized in registers (K packed)
                    w = dequant_gather(w_base, offs_r[:, None], offs_n[None, :], mask_w, stride_w1r, stride_w1k,
                                       s_base, stride_s1r, stride_s1c, zp_ptr + expert.to(tl.int64) * stride_zpe,
                                       stride_zpr, stride_zpc, GROUP_K, W_QUANT, HAS_ZP, grad_h_src.dtype.element_ty)
                else:
                    w = tl.load(w_base + offs_n[None, :] * stride_w1k + offs_r[:, None] * stride_w1r, mask=mask_w,
                                other=0.0)  # [BR, BN]
                    if FP8_W:  # frozen block-fp8 w1, dequantized in registers
                        w = dequant_block(w, s_base, offs_r[:, None], offs_n[None, :], stride_s1r, stride_s1c, mask_w,
                                          SCALE_R, SCALE_C, grad_h_src.dtype.element_ty)
                acc = tl.dot(dh, w, acc, input_precision=PRECISION)
        if LORA:  # the adapter's share: lora_scale * u @ A[e] (remote blocks store nothing)
            if LORA_SLOT_ROWS:
                u_rows = lora_u_ptr + tl.where(mask_m, slots, 0) * stride_lum
            else:
                u_rows = lora_u_ptr + rows * stride_lum
            acc = lora_term(acc, u_rows, mask_m, lora_l_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_lle, offs_n,
                            mask_n, lora_rank, stride_llr, stride_llk, lora_scale, LORA_R, PRECISION)
        if SORTED_OUT:  # every row of the block (padding rows: zero rows of d give zeros)
            tl.store(grad_slots_ptr + rows[:, None] * stride_sm + offs_n[None, :],
                     acc.to(grad_slots_ptr.dtype.element_ty), mask=mask_n[None, :] & local)
        else:
            tl.store(grad_slots_ptr + slots[:, None] * stride_sm + offs_n[None, :],
                     acc.to(grad_slots_ptr.dtype.element_ty), mask=(mask_m & local)[:, None] & mask_n[None, :])


def _launch(
    d: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_post_padded: torch.Tensor, num_slots: int, block_m: int, tiles: InputTiles,
    scale: torch.Tensor | None, block_shape: tuple[int, int] | None, skip_remote: bool,
    partial: torch.Tensor | None = None, grad_weights: torch.Tensor | None = None,
    lora: LoraOperands | None = None, lora_slot_rows: bool = False, tile_m: int | None = None,
    low_bit: WeightScales | None = None,
) -> None:
    """da = d @ w[e] per aligned row block into ``out``: rows = slots, or aligned rows when no
    ``partial`` is given (then no router-weight gradient either). ``scale``/``block_shape``: a
    frozen block-fp8 ``w``'s scales. ``skip_remote``: remote blocks (expert id -1) may be many (an
    expert map): they skip their K loop, and the tile loop does not flatten. ``lora``: the epilogue
    adds ``lora.scale * lora.u[row] @ lora.factor[e].T`` (factor (E, cols, r)), u's rows aligned
    rows or, ``lora_slot_rows``, slots. ``low_bit``: ``w`` holds frozen low-bit codes (C packed, as
    stored) with their group scales and zero points, dequantized in the K loop."""
    p, rows_w, cols = d.shape[0], w.shape[1], logical_cols(w, low_bit.weight_dtype if low_bit else None)
    if low_bit is not None:
        tiles = tiles.for_low_bit()
    if p == 0:
        return
    fp32 = d.dtype == torch.float32
    router_grad = partial is not None
    if (gluon_grad_input is not None and lora is None and tile_m is None and low_bit is None
            and gluon_ready(d.device, "dx", num_slots / max(w.shape[0], 1))):
        engine = GemmConfig(block_m, tiles.block_n, tiles.block_r, num_warps=tiles.num_warps,
                            group_m=row_group(block_m * rows_w * d.element_size()))
        if gluon_grad_input.gluon_grad_input_fits(d, w, out, block_m, engine, scale, skip_remote):
            gluon_grad_input.invoke_gluon_grad_input(d, w, out, sorted_ids, expert_ids, num_post_padded, num_slots,
                                                     block_m, engine, sm_count(d.device), partial, grad_weights,
                                                     PARTS_BLOCK)
            return
    tile_m = tile_m or block_m
    num_pid_m = cdiv(p, tile_m)
    tma = tiles.tma and scale is None and low_bit is None and tma_addressable(d) and tma_addressable(w)
    if tma:
        d_src = TensorDescriptor.from_tensor(d, [tile_m, tiles.block_r])
        w_src = TensorDescriptor.from_tensor(w, [1, tiles.block_r, tiles.block_n])
    else:
        d_src, w_src = d, w
    partial = partial if router_grad else out
    s = scale if scale is not None else low_bit.scale if low_bit is not None else partial
    zp = low_bit.zero_point if low_bit is not None and low_bit.zero_point is not None else None
    programs = persistent_programs(d.device, num_pid_m * cdiv(cols, tiles.block_n))
    if lora is not None:
        u, f = lora.u, lora.factor
        lora_ops = (u, f, f.shape[2], u.stride(0), *f.stride(), float(lora.scale))
    else:
        lora_ops = (out, out, 0, 0, 0, 0, 0, 1.0)
    launch(_moe_grad_input_kernel, (programs,),
           d_src, w_src, partial, sorted_ids, expert_ids, num_post_padded, out,
           grad_weights if router_grad else out, s, *lora_ops,
           num_slots, rows_w, cols, partial.shape[1] if router_grad else 0,
           d.stride(0), *w.stride(), out.stride(0), partial.stride(0), *scale_strides(s),
           zp if zp is not None else out, *(zp.stride() if zp is not None else (0, 0, 0)),
           W_QUANT=low_bit.weight_dtype if low_bit is not None else "none",
           GROUP_K=low_bit.group_size if low_bit is not None else 1, HAS_ZP=zp is not None,
           BLOCK_M=tile_m, BLOCK_N=tiles.block_n, BLOCK_R=tiles.block_r, PARTS_BLOCK=PARTS_BLOCK, EXPERT_BLOCK=block_m,
           PRECISION="ieee" if fp32 else "tf32", FP8_W=scale is not None,
           SCALE_R=block_shape[0] if block_shape else 1, SCALE_C=block_shape[1] if block_shape else 1,
           GROUP_M=row_group(block_m * rows_w * d.element_size()), TMA=tma, ROUTER_GRAD=router_grad,
           SORTED_OUT=not router_grad, SKIP_REMOTE=skip_remote, NUM_PROGRAMS=programs, LORA=lora is not None,
           LORA_R=padded_rank(lora.factor.shape[2]) if lora is not None else 16, LORA_SLOT_ROWS=lora_slot_rows,
           num_warps=tiles.num_warps,
           num_stages=backward_stages(tiles.num_stages, fp32, scale is not None or low_bit is not None))


@with_interpreter_fixes
def sorted_input_grad(
    d: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_post_padded: torch.Tensor, num_slots: int, *, block_m: int, weight_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None, tiles: InputTiles = InputTiles(), skip_remote: bool = True,
    lora: LoraOperands | None = None, tile_m: int | None = None, low_bit: WeightScales | None = None,
) -> torch.Tensor:
    """da (P, C) in aligned-row order, d's dtype: da = d @ w[e] for each aligned row block of expert e.

    Args:
        d: (P, R) aligned rows (``sorted_rows.aligned_copy``; padding rows zero), P = sorted_ids.numel().
        w: (E_local, R, C), d's dtype (or float8_e4m3fn with ``weight_scale`` (E, cdiv(R, bn),
            cdiv(C, bk)) float32 and ``block_shape`` (bn, bk)), any strides.
        sorted_ids, expert_ids, num_post_padded: the align of block ``block_m`` that ordered d;
            num_slots: the sentinel of sorted_ids.
        skip_remote: expert ids may be -1 (remote: an expert map); False where none is, so the
            persistent tile loop flattens (a -1 block is then still correct, its K loop run on zeros).
        lora: each row's da also takes ``lora.scale * u[slot] @ lora.factor[e].T`` (u (num_slots,
            r) by slot, factor (E_local, C, r): w's LoRA update scale * B @ A, with u = d @ B[e]).
        tile_m: rows per tile, a divisor of block_m (None: block_m).
        low_bit: ``w`` is frozen low-bit codes, (E_local, R, C / 2) uint8 for 4-bit (C packed), with
            their group scales and zero points (``WeightScales``), dequantized in the K loop.

    Rows at or past num_post_padded and rows of remote experts (expert id -1) are not written.
    """
    out = torch.empty((d.shape[0], logical_cols(w, low_bit.weight_dtype if low_bit else None)), dtype=d.dtype,
                      device=d.device)
    _launch(d, w, out, sorted_ids, expert_ids, num_post_padded, num_slots, block_m, tiles, weight_scale, block_shape,
            skip_remote, lora=lora, lora_slot_rows=True, tile_m=tile_m, low_bit=low_bit)
    return out


@with_interpreter_fixes
def moe_grad_input(
    grad_h: torch.Tensor, w1: torch.Tensor, partial: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post_padded: torch.Tensor,
    num_experts: int, *, expert_map: torch.Tensor | None = None, num_local_experts: int | None = None,
    block_m: int, tiles: InputTiles, apply_router_weight_on_input: bool = False,
    weight_scales: BlockScales | WeightScales | None = None, lora: LoraOperands | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dx (M, K) in grad_h's dtype, dL/dtopk_weights (M, topk) float32).

    Args:
        grad_h: (P, 2N) and partial: (P, parts) float32, from ``moe_grad_act`` on the same align
            outputs ``sorted_ids``, ``expert_ids``, ``num_post_padded`` (block ``block_m``).
        w1: (E_local, 2N, K), any strides. topk_weights: (M, topk) float32; topk_ids: (M, topk).
        num_experts, expert_map, num_local_experts: the forward's; slots no local expert
            computed get exactly zero gradient.
        apply_router_weight_on_input: the forward scaled the input by the router weight.
        weight_scales: frozen block-fp8 w1 and its block scales (``BlockScales``), or frozen low-bit
            w1 codes (E_local, 2N, K / 2 for 4-bit) with their group scales (``WeightScales``); either
            dequantized in the K loop.
        tiles: the tiles (the rule: ``tmoe.config.backward.input_tiles(M)``).
        lora: w1's LoRA update scale * B1 @ A1: u (P, r) = scale-free grad_h @ B1[e] in aligned rows,
            factor A1 transposed (E_local, K, r); each slot's dx takes ``lora.scale * u @ A1[e]``.
    """
    m, topk = topk_ids.shape
    low_bit = weight_scales if isinstance(weight_scales, WeightScales) else None
    block = weight_scales if isinstance(weight_scales, BlockScales) else None
    k = logical_cols(w1, low_bit.weight_dtype if low_bit else None)
    dev = grad_h.device
    grad_slots = torch.empty((m * topk, k), dtype=grad_h.dtype, device=dev)
    grad_weights = torch.zeros((m, topk), dtype=torch.float32, device=dev)
    _launch(grad_h, w1, grad_slots, sorted_ids, expert_ids, num_post_padded, m * topk, block_m, tiles,
            block.w1_scale if block else None, block.block_shape if block else None,
            expert_map is not None, partial, grad_weights, lora=lora, low_bit=low_bit)
    grad_x = torch.empty((m, k), dtype=grad_h.dtype, device=dev)
    moe_reduce(grad_slots.view(m, topk, k), topk_ids, num_experts,
               topk_weights if apply_router_weight_on_input else None, expert_map, grad_x,
               num_local_experts=num_local_experts)
    return grad_x, grad_weights
