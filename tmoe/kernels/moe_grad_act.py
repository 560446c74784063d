"""Backward of the expert MLP up to the intermediate, one fused M-grouped GEMM per row block.

For slot s (token t, local expert e, router weight w) with the output gradient go = dL/dout[t]:
    g   = go @ w2[e]                      (N)   the gradient of the intermediate before w
    h   = x[t] @ w1[e].T (* w) + b1[e]    (2N)  the pre-activation (x[t] @ w1[e].T saved by the forward, or recomputed)
    a   = act(h)                          (N)   the intermediate, for dW2
    dh  = (w * g) * act'(h)               (2N)  (apply_router_weight_on_input: g * act'(h))
    dw  = <g, a> + <go, b2[e]>                  the router weight's gradient (on input: <dh, x[t] @ w1[e].T>)
Each program owns BLOCK_M aligned rows (one expert) and BLOCK_N intermediate columns: one K loop
feeds the three dots (go @ w2 tile, x @ gate rows, x @ up rows; interleaved gate/up rows: one dot
over the contiguous [2BN] rows, split after the loop), the epilogue applies the
activation's derivative. ``dh`` and ``a`` are written in aligned-row order (the order the dX and
dW GEMMs read them; padding rows are zeros), ``dw`` as one float32 partial per (row, column
block), summed in a fixed order by ``moe_grad_input``. No atomics: deterministic. Tiles run in
grouped order (``sizes.row_group`` row blocks sweep the column blocks together).
Where the operands allow it (``tma_operands_fit``: float weights, w1 K-contiguous, w2
N-contiguous, gate/up not interleaved), grad_out and x are first copied into aligned-row order
(``sorted_rows``, padding rows zero) and every operand loads by TMA: the gathered rows' [BM, BK]
pointer tensors of the other path spilled registers at 128-row blocks. Else rows are gathered
through their tokens and the weights read by pointers (any strides, interleaved rows, fp8).
``g_first`` (``ActTiles``, chosen by ``tmoe.config.backward.act_tiles``): g is first computed for every aligned row as its own M-grouped GEMM
(``moe_grad_input.sorted_input_grad`` on an aligned copy of grad_out: w2 read as stored) and
rounded to x's dtype, as a torch autograd of the layer rounds it; the fused kernel's K loop then
runs the two dots of the recomputed pre-activation alone (the forward's up GEMM, on wide tiles)
and its epilogue loads g. With the forward's saved x @ w1.T (``preact``, rows = slots) no dot is
left: g first, then this kernel is one elementwise pass that gathers its rows through the slots.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tmoe.kernels._details.activation_grad import act_and_mul_grad, act_no_mul_grad
from tmoe.kernels._details.grad_act_dots import grad_act_dots
from tmoe.kernels._details.lora_dot import lora_term
from tmoe.kernels._details.tile_matmul import tile_ids
from tmoe.kernels.activation import Activation
from tmoe.kernels.grad_checks import check_preact
from tmoe.kernels.gemm_args import tma_addressable
from tmoe.kernels.grad_config import ActTiles
from tmoe.kernels.lora import LoraOperands, padded_rank
from tmoe.kernels.moe_grad_input import sorted_input_grad
from tmoe.kernels.operands import BlockScales, Routing, WeightScales, logical_cols, scale_strides
from tmoe.kernels.sizes import backward_stages, cdiv, row_group
from tmoe.kernels.sorted_rows import aligned_copy
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch


@triton.jit(do_not_specialize=['num_slots', 'num_pid_m'])
def _moe_grad_act_kernel(
    grad_out_src,  # [M, K] dL/dout (TMA: descriptor of its aligned-row copy [P, K], block [BLOCK_M, BLOCK_K])
    x_src,  # [M, K] (TMA: as grad_out_src)
    w1_src,  # [E, W1_ROWS, K] (gate rows, up rows; INTERLEAVED: alternating) (TMA: block [1, BLOCK_N, BLOCK_K])
    w2_src,  # [E, K, N] (TMA: block [1, BLOCK_K, BLOCK_N])
    b1_ptr,  # [E, W1_ROWS] (HAS_B1)
    b2_ptr,  # [E, K] (HAS_B2)
    topk_weights_ptr,  # [num_slots] float32
    sorted_ids_ptr,  # [P] int32 aligned slot ids, padding >= num_slots
    expert_ids_ptr,  # [P // BLOCK_M] int32, -1 remote
    num_post_padded_ptr,  # [1] int32
    g_ptr,  # [P, N] aligned rows: g = go @ w2[e] (G_FIRST)
    preact_ptr,  # [num_slots, W1_ROWS] the forward's pre-activation, row = slot, gate then up columns (SAVED)
    grad_h_ptr,  # [P, W1_ROWS] out, aligned rows, w1's row order
    inter_ptr,  # [P, N] out, aligned rows: w * act(h) (ON_INPUT: act(h))
    partial_ptr,  # [P, NUM_PID_N] float32 out
    s1_ptr,  # [E, cdiv(W1_ROWS, SCALE_R), cdiv(K, SCALE_C)] float32 (FP8_W: w1 = q * s)
    s2_ptr,  # [E, cdiv(K, SCALE_R), cdiv(N, SCALE_C)] float32 (FP8_W)
    lora_t_ptr,  # LORA_PRE: [num_slots, rank] t = x @ A1[e].T of each slot
    lora_b_ptr,  # LORA_PRE: [E, W1_ROWS, rank] B1 (w1's row order)
    num_slots, N, K, alpha, limit, num_pid_m,
    stride_gm, stride_gk, stride_xm, stride_xk, stride_w1e, stride_w1r, stride_w1k, stride_w2e, stride_w2k,
    stride_w2n, stride_b1e, stride_b2e, stride_g, stride_hm, stride_im, stride_pm, stride_s1e, stride_s1r, stride_s1c,
    stride_s2e, stride_s2r, stride_s2c, stride_pre, lora_rank, stride_ltm, stride_lbe, stride_lbn, stride_lbr,
    lora_scale,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACTIVATION: tl.constexpr, MUL: tl.constexpr, CLAMP: tl.constexpr, INTERLEAVED: tl.constexpr,
    ON_INPUT: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, PRECISION: tl.constexpr,
    FP8_W: tl.constexpr, SCALE_R: tl.constexpr, SCALE_C: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
    G_FIRST: tl.constexpr, SAVED: tl.constexpr, LORA_PRE: tl.constexpr, LORA_R: tl.constexpr,
):
    LOAD_GO: tl.constexpr = HAS_B2 or not G_FIRST  # g's dot, and <go, b2>
    K_LOOP: tl.constexpr = LOAD_GO or not SAVED  # SAVED (with G_FIRST): no dot is left but <go, b2>
    pid_m, pid_n = tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    pid_m = pid_m.to(tl.int64)
    pid_n = pid_n.to(tl.int64)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] aligned rows
    slots = tl.load(sorted_ids_ptr + rows).to(tl.int64)
    mask_m = slots < num_slots
    tokens = tl.where(mask_m, slots // TOPK, 0)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < N
    # PAIRED (interleaved gate/up): W1's rows 2j, 2j + 1 of the block read and written as one
    # contiguous [2BN] run (strided halves do not coalesce when W1 is stored transposed, nor do
    # grad_h's stores), its products split into gate and up after the K loop
    PAIRED: tl.constexpr = MUL and INTERLEAVED
    pair_rows = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # [2BN] (PAIRED)
    mask_pair = pair_rows < 2 * N
    if MUL:
        gate_rows = offs_n * (1 + INTERLEAVED)  # [BN]
        up_rows = gate_rows + (1 if INTERLEAVED else N)
    else:
        gate_rows = offs_n
        up_rows = offs_n
    mask_out = mask_m[:, None] & mask_n[None, :]
    h_ptrs = grad_h_ptr + rows[:, None] * stride_hm  # [BM, 1]
    i_ptrs = inter_ptr + rows[:, None] * stride_im + offs_n[None, :]  # [BM, BN]
    p_ptrs = partial_ptr + rows * stride_pm + pid_n  # [BM]
    if expert < 0:  # remote: no gradient flows through these slots
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=grad_h_ptr.dtype.element_ty)
        if PAIRED:
            tl.store(h_ptrs + pair_rows[None, :], tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=grad_h_ptr.dtype.element_ty),
                     mask=mask_pair[None, :])
        else:
            tl.store(h_ptrs + gate_rows[None, :], zeros, mask=mask_n[None, :])
            if MUL:
                tl.store(h_ptrs + up_rows[None, :], zeros, mask=mask_n[None, :])
        tl.store(i_ptrs, zeros.to(inter_ptr.dtype.element_ty), mask=mask_n[None, :])
        tl.store(p_ptrs, tl.zeros((BLOCK_M,), dtype=tl.float32))
        return
    acc_g, acc_gate, acc_up, acc_pair, acc_b2 = grad_act_dots(
        grad_out_src, x_src, w1_src, w2_src, b2_ptr, s1_ptr, s2_ptr, pid_m, pid_n, expert, tokens, mask_m, offs_n,
        mask_n, gate_rows, up_rows, pair_rows, mask_pair, N, K, stride_gm, stride_gk, stride_xm, stride_xk,
        stride_w1e, stride_w1r, stride_w1k, stride_w2e, stride_w2k, stride_w2n, stride_b2e, stride_s1e, stride_s1r,
        stride_s1c, stride_s2e, stride_s2r, stride_s2c, BLOCK_M, BLOCK_N, BLOCK_K, MUL, PAIRED, HAS_B2, PRECISION,
        FP8_W, SCALE_R, SCALE_C, TMA, G_FIRST, SAVED, LOAD_GO, K_LOOP,
    )  # [BM, BN] float32 each ([BM, 2BN] acc_pair, [BM] acc_b2); zeros where no dot ran
    if G_FIRST:  # rows of padding read zero
        acc_g = tl.load(g_ptr + rows[:, None] * stride_g + offs_n[None, :], mask=mask_out, other=0.0).to(tl.float32)
    w = tl.load(topk_weights_ptr + slots, mask=mask_m, other=0.0)  # [BM] float32
    if SAVED:  # x @ w1.T as the forward stored it (the router weight and the bias are applied below)
        pre = preact_ptr + tl.where(mask_m, slots, 0)[:, None] * stride_pre + offs_n[None, :]  # [BM, BN]
        acc_gate = tl.load(pre, mask=mask_out, other=0.0).to(tl.float32)
        if MUL:
            acc_up = tl.load(pre + N, mask=mask_out, other=0.0).to(tl.float32)
    elif PAIRED:
        acc_gate, acc_up = tl.split(tl.reshape(acc_pair, (BLOCK_M, BLOCK_N, 2)))
    if LORA_PRE:  # the recomputed x @ w1.T takes w1's adapter term, as the forward's epilogue added it
        t_rows = lora_t_ptr + tl.where(mask_m, slots, 0) * stride_ltm
        b_base = lora_b_ptr + expert * stride_lbe
        acc_gate = lora_term(acc_gate, t_rows, mask_m, b_base, gate_rows, mask_n, lora_rank, stride_lbr, stride_lbn,
                             lora_scale, LORA_R, PRECISION)
        if MUL:
            acc_up = lora_term(acc_up, t_rows, mask_m, b_base, up_rows, mask_n, lora_rank, stride_lbr, stride_lbn,
                               lora_scale, LORA_R, PRECISION)
    hg, hu = acc_gate, acc_up
    if ON_INPUT:  # the forward scales the input: h = w * (x @ w1.T) + b1
        hg = hg * w[:, None]
        hu = hu * w[:, None]
    if HAS_B1:
        if PAIRED:
            b1g, b1u = tl.split(tl.reshape(tl.load(b1_ptr + expert * stride_b1e + pair_rows, mask=mask_pair,
                                                   other=0.0).to(tl.float32), (BLOCK_N, 2)))
            hg += b1g[None, :]
            hu += b1u[None, :]
        else:
            hg += tl.load(b1_ptr + expert * stride_b1e + gate_rows, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if MUL:
                hu += tl.load(b1_ptr + expert * stride_b1e + up_rows, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if MUL:
        a, d_gate, d_up = act_and_mul_grad(hg, hu, alpha, limit, ACTIVATION, CLAMP)
    else:
        a, d_gate = act_no_mul_grad(hg, ACTIVATION)
        d_up = d_gate  # unused
    a = tl.where(mask_out, a, 0.0).to(inter_ptr.dtype.element_ty)  # rounded as the forward writes it
    if ON_INPUT:
        tl.store(i_ptrs, a, mask=mask_n[None, :])
    else:  # w * a: dW2 then reads both of its operands straight from memory
        tl.store(i_ptrs, (a.to(tl.float32) * w[:, None]).to(inter_ptr.dtype.element_ty), mask=mask_n[None, :])
    da = acc_g if ON_INPUT else acc_g * w[:, None]
    dh_gate = tl.where(mask_out, da * d_gate, 0.0)
    dh_up = tl.where(mask_out, da * d_up, 0.0)  # read only when MUL
    if PAIRED:
        dh = tl.reshape(tl.join(dh_gate, dh_up), (BLOCK_M, 2 * BLOCK_N))  # [BM, 2BN] in W1's row order
        tl.store(h_ptrs + pair_rows[None, :], dh.to(grad_h_ptr.dtype.element_ty), mask=mask_pair[None, :])
    else:
        tl.store(h_ptrs + gate_rows[None, :], dh_gate.to(grad_h_ptr.dtype.element_ty), mask=mask_n[None, :])
        if MUL:
            tl.store(h_ptrs + up_rows[None, :], dh_up.to(grad_h_ptr.dtype.element_ty), mask=mask_n[None, :])
    if ON_INPUT:  # dL/dw = <dh, x @ w1.T>
        part = tl.sum(dh_gate * acc_gate, axis=1)
        if MUL:
            part += tl.sum(dh_up * acc_up, axis=1)
    else:  # dL/dw = <go, w2 @ a + b2> = <g, a> + <go, b2>
        part = tl.sum(acc_g * a.to(tl.float32), axis=1)
        if HAS_B2:
            part += tl.where(pid_n == 0, acc_b2, 0.0)
    tl.store(p_ptrs, tl.where(mask_m, part, 0.0))


@with_interpreter_fixes
def moe_grad_act(
    grad_out: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk: int, sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post_padded: torch.Tensor, *,
    activation: Activation, block_m: int, tiles: ActTiles, apply_router_weight_on_input: bool = False,
    w1_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
    weight_scales: BlockScales | None = None, preact: torch.Tensor | None = None, lora: LoraOperands | None = None,
    lora_pre: LoraOperands | None = None, w2_low_bit: WeightScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The intermediate's gradient, the intermediate and the router weights' partial gradients.

    Args:
        grad_out: (M, K) gradient of the layer output, x's dtype; x: (M, K) float16/bfloat16/float32.
        w1: (E, 2N, K) (E, N, K for a *_no_mul activation); w2: (E, K, N); x's dtype, any strides.
        topk_weights: (M, topk) float32, contiguous.
        sorted_ids, expert_ids, num_post_padded: ``moe_align_block_size(topk_ids, block_m, ...)``.
        tiles: the tiles (the rule: ``tmoe.config.backward.act_tiles(block_m)``).
        activation, apply_router_weight_on_input, w1_bias (E, 2N), w2_bias (E, K): the forward's.
        weight_scales: frozen block-fp8 w1/w2 (float8_e4m3fn) and their block scales; the
            weights are dequantized to x's dtype in the K loop (x itself is not quantized).
        preact: (M * topk, 2N) (N for a *_no_mul activation), x's dtype, contiguous rows: the
            forward's x @ w1[e].T of every slot (row = slot, gate columns then up; before the
            router weight and the bias; ``check_preact``). Then nothing is recomputed: g = go @ w2
            runs first (g_first) and this kernel is elementwise, reading h's product from ``preact``.
        lora: w2's LoRA term of g: g = go @ (w2[e] + scale * b @ a) as ``sorted_input_grad``'s
            ``lora`` (u = go @ b[e] per slot, factor a[e] transposed); g then runs first.
        lora_pre: w1's LoRA term of the recomputed pre-activation (without ``preact``): u = x @ a1[e].T
            per slot (M * topk, r), factor b1 (E, 2N, r), added as the forward's epilogue adds it.
        w2_low_bit: w2 is frozen low-bit codes ((E, K, N / 2) uint8 for 4-bit) with their group
            scales (``WeightScales``), dequantized in g's K loop; needs ``preact`` (w1 is not read:
            the op, ``tmoe::moe_grad_act``, refuses the call without it).

    Returns:
        grad_h (P, 2N) in aligned-row order and w1's row order, x's dtype (rows of padding and
        remote experts zero); inter (P, N) the recomputed intermediate act(h), x's dtype;
        inter is act(h) times the router weight (dW2 = sum go^T inter), or act(h) itself when the
        forward applied the router weight on the input;
        partial (P, cdiv(N, tiles.block_n)) float32, dL/dw of each aligned row per column block
        (P = sorted_ids.numel(); rows at or past num_post_padded are not written).
    """
    check_preact(preact, x, w1, topk_weights)
    num_slots = topk_weights.numel()
    n, k, p = logical_cols(w2, w2_low_bit.weight_dtype if w2_low_bit else None), x.shape[1], sorted_ids.shape[0]
    alpha, limit, clamp = activation.floats()
    grad_h = torch.empty((p, w1.shape[1]), dtype=x.dtype, device=x.device)  # w1's rows: 2N, or N for *_no_mul
    inter = torch.empty((p, n), dtype=x.dtype, device=x.device)
    if preact is not None:  # no dot left in the kernel: g first, rows gathered by pointers (no copy of x)
        tiles = replace(tiles, g_first=True, tma=False)
    elif lora is not None:  # g's adapter term is an epilogue of g's own GEMM
        tiles = replace(tiles, g_first=True)
    num_pid_n = cdiv(n, tiles.block_n)
    partial = torch.empty((p, num_pid_n), dtype=torch.float32, device=x.device)
    if p == 0:
        return grad_h, inter, partial
    b1 = w1_bias if w1_bias is not None else topk_weights
    b2 = w2_bias if w2_bias is not None else topk_weights
    s1, s2 = (weight_scales.w1_scale, weight_scales.w2_scale) if weight_scales else (partial, partial)
    fp32 = x.dtype == torch.float32
    num_pid_m = cdiv(p, block_m)
    block_k = min(tiles.block_k, 32) if fp32 else tiles.block_k
    tma = tiles.tma and weight_scales is None and tma_operands_fit(x, w1, w2, activation)
    routing = Routing(sorted_ids, expert_ids, num_post_padded, num_slots, topk)
    go_rows = aligned_copy(grad_out, routing) if tma or tiles.g_first else None
    if tiles.g_first:
        g = sorted_input_grad(go_rows, w2, sorted_ids, expert_ids, num_post_padded, num_slots, block_m=block_m,
                              weight_scale=weight_scales.w2_scale if weight_scales else None,
                              block_shape=weight_scales.block_shape if weight_scales else None,
                              skip_remote=preact is None,  # a saving forward had no expert map
                              lora=lora, low_bit=w2_low_bit)
    else:
        g = inter  # not read
    if lora_pre is not None:
        t, f = lora_pre.u, lora_pre.factor
        lora_pre_ptrs, lora_pre_args = (t, f), (f.shape[2], t.stride(0), *f.stride(), float(lora_pre.scale))
    else:
        lora_pre_ptrs, lora_pre_args = (g, g), (0, 0, 0, 0, 0, 1.0)
    if tma:  # grad_out and x rows copied into aligned order (padding rows zero), every operand by TMA
        go_src, x_src = (TensorDescriptor.from_tensor(rows, [block_m, block_k])
                         for rows in (go_rows, aligned_copy(x, routing)))
        w1_src = TensorDescriptor.from_tensor(w1, [1, tiles.block_n, block_k])
        w2_src = TensorDescriptor.from_tensor(w2, [1, block_k, tiles.block_n])
    else:
        go_src, x_src, w1_src, w2_src = grad_out, x, w1, w2
    launch(_moe_grad_act_kernel, (num_pid_m * num_pid_n,),
           go_src, x_src, w1_src, w2_src, b1, b2, topk_weights, sorted_ids, expert_ids, num_post_padded, g,
           preact if preact is not None else g, grad_h, inter, partial,
           s1, s2, *lora_pre_ptrs, num_slots, n, k, alpha, limit, num_pid_m,
           grad_out.stride(0), grad_out.stride(1), x.stride(0), x.stride(1), *w1.stride(), *w2.stride(),
           b1.stride(0), b2.stride(0), g.stride(0), grad_h.stride(0), inter.stride(0), partial.stride(0),
           *scale_strides(s1), *scale_strides(s2), preact.stride(0) if preact is not None else 0, *lora_pre_args,
           LORA_PRE=lora_pre is not None, LORA_R=padded_rank(lora_pre.factor.shape[2]) if lora_pre is not None else 16,
           FP8_W=weight_scales is not None,
           SCALE_R=weight_scales.block_shape[0] if weight_scales else 1,
           SCALE_C=weight_scales.block_shape[1] if weight_scales else 1,
           TOPK=topk, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k, TMA=tma, G_FIRST=tiles.g_first,
           SAVED=preact is not None,
           ACTIVATION=activation.name,
           MUL=activation.mul, CLAMP=clamp, INTERLEAVED=activation.interleaved, ON_INPUT=apply_router_weight_on_input,
           HAS_B1=w1_bias is not None, HAS_B2=w2_bias is not None,
           GROUP_M=row_group(2 * block_m * k * x.element_size()),  # x and grad_out rows
           PRECISION="ieee" if fp32 else "tf32", num_warps=tiles.num_warps,
           num_stages=backward_stages(tiles.num_stages, fp32, weight_scales is not None))
    return grad_h, inter, partial


def tma_operands_fit(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: Activation) -> bool:
    """Whether ``moe_grad_act`` can load every operand by TMA: rows of x (and so of its aligned
    copies) 16-byte multiples, w1 K-contiguous and w2 N-contiguous (TMA-addressable), gate and up
    rows not interleaved."""
    return (not activation.interleaved and x.shape[1] * x.element_size() % 16 == 0
            and tma_addressable(w1) and tma_addressable(w2))
