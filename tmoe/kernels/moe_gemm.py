"""The two expert GEMMs: fused up/gate + activation, and down (optionally times the router weight).

One kernel serves both (``GATED``: the up GEMM, with the activation epilogue; ``MUL`` the
activation's form act(gate) * up over W1's 2N rows, else act(h) over N rows) and three row layouts
(``ROUTE``, the int of ``Route.gemm_rows`` that the plan decided): SORTED (Standard format, rows found
through the sorted slot ids of the align stage), BATCHED (BatchedExperts, rows ``[0,
expert_num_tokens[e])`` of each expert's fixed-capacity batch) and SLOTS (Standard format without
the align stage: one program row per slot, its expert read from topk_ids; the SLOTS and DIRECT
routes, for decode, where nearly every slot has an expert of its own). The grid covers the worst
case; programs read the real token counts from device memory and return early. ``PERSISTENT`` (sorted route, TMA weights; ``GemmConfig.persistent``): at most one
program per SM, each walking the valid tiles (read from num_tokens_post_padded) in grouped order.
``HALVES`` (W1 stored transposed, its rows contiguous; pointer loads): the up tile reads gate rows
then up rows as two contiguous runs (``common.w1_columns``) instead of alternating rows.
All row and expert offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels._details.common import local_expert, split_gate_up, w1_columns
from tmoe.kernels._details.tile_matmul import moe_tile_matmul, moe_tile_matmul_tma, tile_ids
from tmoe.kernels.activation import NO_ACTIVATION_ARGS, Activation
from tmoe.kernels.sizes import cdiv
from tmoe.kernels._details.dequant import b_rows, zero_point_rows
from tmoe.kernels._details.gemm_epilogue import moe_epilogue
from tmoe.kernels.gemm_args import (
    fit_shared_memory, fit_low_bit, fused_quant_group, scale_args, persistent_epilogue_bytes, uniform_w_scale, up_in_halves,
    weight_bytes, weight_descriptor,
)
from tmoe.kernels.lora import LoraOperands, lora_adapter_args, lora_args
from tmoe.kernels.operands import DirectRouting, Routing, Scales, WeightScales
from tmoe.kernels.route import Route
from tmoe.runtime.device import persistent_programs, shared_memory_budget
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch
from tmoe.runtime.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from tmoe.runtime.plan import Launch, planned

_BATCHED_ROWS: tl.constexpr = tl.constexpr(int(Route.BATCHED))  # ROUTE values (Route.gemm_rows)
_SLOT_ROWS: tl.constexpr = tl.constexpr(int(Route.SLOTS))


@triton.jit
def _sorted_block(sorted_ids_ptr, expert_ids_ptr, pid_m, num_slots, BLOCK_M: tl.constexpr):
    """(slots [BM] int64, mask_m [BM], expert int64) of aligned row block ``pid_m``: its slot ids as
    the align stage sorted them (padding ids, >= num_slots, masked) and its expert (-1: remote)."""
    slots = tl.load(sorted_ids_ptr + pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return slots, slots < num_slots, tl.load(expert_ids_ptr + pid_m).to(tl.int64)


@triton.jit(do_not_specialize=['num_slots', 'num_pid_m'])
def _moe_gemm_kernel(
    a_ptr,  # Standard: [rows, K]; Batched: [E, cap, K]
    w_ptr,  # [E, N_w, K]: N_w = 2N when MUL (gate rows, up rows; INTERLEAVED: 2j gate j, 2j + 1 up j), else N
    # (W_DESC: its TMA descriptor)
    out_ptr,  # Standard: [num_slots, N]; Batched: [E, cap, N]
    a_scale_ptr,  # [rows, K // GROUP_K] (zero strides broadcast per-tensor scales)
    w_scale_ptr,  # [E, N_w // GROUP_N, K // GROUP_K]
    topk_weights_ptr,  # [num_slots] float32
    bias_ptr,  # [E, N_w] expert biases (HAS_BIAS), in w's row order
    sorted_ids_ptr,  # [EM] int32, Standard only
    expert_ids_ptr,  # [EM // BLOCK_M] int32, Standard only
    num_post_padded_ptr,  # [1] int32, Standard only
    expert_num_tokens_ptr,  # [E] int32, Batched only
    topk_ids_ptr,  # [num_slots] int32/int64, direct only
    expert_map_ptr,  # [num_experts] int32 global -> local id or -1 (HAS_MAP), direct only
    out_scale_ptr,  # QUANT_OUT: [rows, cdiv(N, GROUP_OUT)] float32 (Batched: [E, cap, ...])
    w_zp_ptr,  # HAS_ZP: low-bit zero points, int4 [E, N_w // 2, K // GROUP_K], int8 [E, N_w, K // GROUP_K]
    pre_ptr,  # SAVE_PRE (gated, Standard): [num_slots, N_w] the pre-activation, row = slot
    lora_u_ptr,  # LORA (Standard): [num_slots, rank] t = a @ A[e].T of each slot, row = slot
    lora_b_ptr,  # LORA: [E, N_w, rank] B, W's LoRA factor (its rows in W's row order)
    lora_rank, stride_lum, stride_lbe, stride_lbn, stride_lbr, lora_scale,
    lora_adapter_ptr,  # LORA_ADAPTERS: [num_slots] int32 each slot's adapter (-1: none); B is [L, E, N_w, rank]
    lora_num_adapters, stride_lbl,
    N, K, num_slots, a_row_div, num_pid_m, blocks_per_expert, num_experts, num_local_experts,
    stride_ae, stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_oe, stride_om, stride_on,
    stride_ase, stride_asm, stride_ask,
    stride_wse, stride_wsn, stride_wsk, stride_be,
    stride_ose, stride_osm, stride_osg, stride_zpe, stride_zpn, stride_zpk, stride_pm, quant_eps, act_alpha,
    act_limit, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATED: tl.constexpr, MUL: tl.constexpr, INTERLEAVED: tl.constexpr, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr,
    QUANT: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, QUANT_OUT: tl.constexpr, GROUP_OUT: tl.constexpr,
    ROUTE: tl.constexpr, HAS_MAP: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    W_DESC: tl.constexpr, UNIFORM_W_SCALE: tl.constexpr, HAS_ZP: tl.constexpr, ASM_UNPACK: tl.constexpr,
    SWAP_AB: tl.constexpr, USE_PDL: tl.constexpr, PERSISTENT: tl.constexpr, HALVES: tl.constexpr,
    SAVE_PRE: tl.constexpr, LORA: tl.constexpr, LORA_R: tl.constexpr, LORA_ADAPTERS: tl.constexpr,
):
    pdl_wait(USE_PDL)  # PDL: before anything is read; the next kernel may start after the K loop (pdl.py)
    if PERSISTENT:  # sorted route, TMA weights: each program walks the valid tiles, grid-size apart
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_valid_m = tl.load(num_post_padded_ptr) // BLOCK_M
        for tile in range(tl.program_id(0), num_valid_m * num_pid_n, tl.num_programs(0)):
            pid_m, pid_n = tile_ids(tile, num_valid_m, num_pid_n, GROUP_M)
            slots, mask_m, expert = _sorted_block(sorted_ids_ptr, expert_ids_ptr, pid_m, num_slots, BLOCK_M)
            offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
            mask_n = offs_n < N
            out_ptrs = out_ptr + slots[:, None] * stride_om + offs_n[None, :] * stride_on  # [BM, BN]
            if expert < 0:  # remote (expert_map): the slots contribute exactly zero
                tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty),
                         mask=mask_m[:, None] & mask_n[None, :])
            else:
                a_rows = (slots // a_row_div)  # [BM]
                a_ptrs = a_ptr + a_rows[:, None] * stride_am + tl.arange(0, BLOCK_K)[None, :] * stride_ak  # [BM, BK]
                acc, up = moe_tile_matmul_tma(
                    a_ptrs, w_ptr, 0, mask_m, expert.to(tl.int32), pid_n * BLOCK_N, N + pid_n * BLOCK_N, N * (1 + MUL),
                    a_scale_ptr + a_rows * stride_asm, w_scale_ptr + expert * stride_wse,
                    K, stride_ak, stride_ask, stride_wsn, stride_wsk,
                    BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N, GROUP_K, QUANT, MUL, UNIFORM_W_SCALE, EVEN_K, PRECISION,
                )  # [BM, BN] float32 each (up: MUL only)
                bias_ptrs = bias_ptr + expert * stride_be + offs_n * (1 + INTERLEAVED)  # [BN] (INTERLEAVED: gate at 2n)
                moe_epilogue(acc, up, out_ptrs, mask_m, mask_n, offs_n, slots, bias_ptrs, topk_weights_ptr,
                             out_scale_ptr + slots * stride_osm, pre_ptr + slots * stride_pm, pid_n, N, stride_osg,
                             quant_eps, act_alpha, act_limit, BLOCK_M, BLOCK_N, GATED, MUL, INTERLEAVED, ACTIVATION,
                             CLAMP, MUL_ROUTED_WEIGHT, HAS_BIAS, QUANT_OUT, GROUP_OUT, SAVE_PRE,
                             lora_u_ptr + slots * stride_lum, lora_b_ptr + expert * stride_lbe, lora_rank, stride_lbn,
                             stride_lbr, lora_scale, lora_adapter_ptr + slots, lora_num_adapters, stride_lbl, LORA,
                             LORA_R, LORA_ADAPTERS, PRECISION)
        pdl_launch_dependents(USE_PDL)
    else:  # one program per output tile
        pid_m, pid_n = tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
        offs_bm = tl.arange(0, BLOCK_M)
        if ROUTE == _BATCHED_ROWS:
            expert = (pid_m // blocks_per_expert).to(tl.int64)
            first_row = (pid_m % blocks_per_expert) * BLOCK_M
            num_rows = tl.load(expert_num_tokens_ptr + expert)
            if first_row >= num_rows:
                return
            rows = (first_row + offs_bm).to(tl.int64)  # [BM]
            slots = rows  # read only with a routed weight, which the Batched format does not take
            mask_m = rows < num_rows
            a_rows = expert * stride_ae + rows * stride_am
            out_rows = expert * stride_oe + rows * stride_om
            scale_rows = expert * stride_ase + rows * stride_asm
            out_scale_rows = expert * stride_ose + rows * stride_osm
        else:
            if ROUTE == _SLOT_ROWS:  # row 0 of the block is slot pid_m, the other rows are masked
                slots = pid_m.to(tl.int64) + offs_bm  # [BM]
                mask_m = offs_bm == 0
                expert = local_expert(topk_ids_ptr, expert_map_ptr, pid_m.to(tl.int64), num_experts, num_local_experts,
                                      HAS_MAP)
            else:
                if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
                    return
                slots, mask_m, expert = _sorted_block(sorted_ids_ptr, expert_ids_ptr, pid_m, num_slots, BLOCK_M)
            a_rows = (slots // a_row_div) * stride_am
            out_rows = slots * stride_om
            scale_rows = (slots // a_row_div) * stride_asm
            out_scale_rows = slots * stride_osm
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        mask_n = offs_n < N
        out_ptrs = out_ptr + out_rows[:, None] + offs_n[None, :] * stride_on  # [BM, BN]
        mask_out = mask_m[:, None] & mask_n[None, :]
        if expert < 0:  # remote (expert_map) or, direct, an out-of-range id or map entry: the slots add exactly 0
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=mask_out)
            return
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] + offs_k[None, :] * stride_ak  # [BM, BK]
        if W_DESC:  # gate rows n, up rows N + n of W1 as two TMA tiles (INTERLEAVED: the launcher uses pointers)
            acc, up = moe_tile_matmul_tma(
                a_ptrs, w_ptr, 0, mask_m, expert.to(tl.int32), pid_n * BLOCK_N, N + pid_n * BLOCK_N, N * (1 + MUL),
                a_scale_ptr + scale_rows, w_scale_ptr + expert * stride_wse,
                K, stride_ak, stride_ask, stride_wsn, stride_wsk,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N, GROUP_K, QUANT, MUL, UNIFORM_W_SCALE, EVEN_K, PRECISION,
            )  # [BM, BN] float32 each (up: MUL only)
        else:
            w_cols, mask_c = w1_columns(pid_n, N, BLOCK_N, MUL, INTERLEAVED, HALVES)  # [BN] ([2BN] gate and up when MUL)
            zp_rows, zp_shift = zero_point_rows(w_cols, QUANT)  # [BN] (2BN when MUL)
            offs_wk, _ = b_rows(BLOCK_K, QUANT)  # [BK] ([BK/2] 4-bit packed bytes)
            acc = moe_tile_matmul(
                a_ptrs,
                w_ptr + expert * stride_we + offs_wk[:, None] * stride_wk + w_cols[None, :] * stride_wn,
                mask_m, mask_c,
                a_scale_ptr + scale_rows,
                w_scale_ptr + expert * stride_wse + (w_cols // GROUP_N) * stride_wsn,
                w_zp_ptr + expert * stride_zpe + zp_rows * stride_zpn, zp_shift,
                K, stride_ak, stride_wk, stride_ask, stride_wsk, stride_zpk,
                BLOCK_M, BLOCK_N * (1 + MUL), BLOCK_K, GROUP_K, QUANT, HAS_ZP, EVEN_K, PRECISION, ASM_UNPACK, SWAP_AB,
            )  # [BM, BN] float32, [BM, 2BN] when MUL
            if MUL:
                acc, up = split_gate_up(acc, BLOCK_M, BLOCK_N, HALVES)
            else:
                up = acc  # read only when MUL
        pdl_launch_dependents(USE_PDL)
        bias_ptrs = bias_ptr + expert * stride_be + offs_n * (1 + INTERLEAVED)  # [BN] (INTERLEAVED: gate at 2n)
        moe_epilogue(acc, up, out_ptrs, mask_m, mask_n, offs_n, slots, bias_ptrs, topk_weights_ptr,
                     out_scale_ptr + out_scale_rows, pre_ptr + slots * stride_pm, pid_n, N, stride_osg, quant_eps,
                     act_alpha, act_limit, BLOCK_M, BLOCK_N, GATED, MUL, INTERLEAVED, ACTIVATION, CLAMP,
                     MUL_ROUTED_WEIGHT, HAS_BIAS, QUANT_OUT, GROUP_OUT, SAVE_PRE,
                     lora_u_ptr + slots * stride_lum, lora_b_ptr + expert * stride_lbe, lora_rank, stride_lbn,
                     stride_lbr, lora_scale, lora_adapter_ptr + slots, lora_num_adapters, stride_lbl, LORA, LORA_R,
                     LORA_ADAPTERS, PRECISION)


@with_interpreter_fixes
@planned
def invoke_moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    config: GemmConfig,
    *,
    gated: bool,
    activation: Activation | None = None,
    routing: Routing | DirectRouting | None = None,
    expert_num_tokens: torch.Tensor | None = None,
    route: Route = Route.SORTED,
    topk_weights: torch.Tensor | None = None,
    scales: Scales | WeightScales | None = None,
    bias: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    quant_eps: float = 1e-10,
    pre_out: torch.Tensor | None = None,
    lora: LoraOperands | None = None,
) -> torch.Tensor:
    """Launch one expert GEMM into ``out`` (..., N_out): N_out columns, the intermediate size N for
    the up GEMM. ``route`` (the plan's) picks the rows: SORTED with an aligned ``routing``
    (``Routing``), SLOTS or DIRECT with a per-slot ``routing`` (``DirectRouting``, ``config.block_m``
    16), BATCHED with ``expert_num_tokens``. ``topk_weights`` ([num_slots] float32) multiplies
    each slot's accumulator (Standard only); ``bias`` (E, N_w) is added per expert before the
    activation (gated) or before the weight (down). ``out_scale`` (gated, fp8 ``out``): the epilogue
    quantizes per 1 x g group, g = N_out // out_scale.shape[-1] (a divisor of ``config.block_n``),
    writing the codes to ``out`` and the scales, max(absmax, quant_eps) / 448, to ``out_scale``
    (rows, N_out / g), exactly as ``per_token_group_quant_fp8`` of the float32 intermediate.
    ``gated`` (the up GEMM, ``activation`` given; None: silu): ``w`` is (E, 2N, K) for act(gate) * up
    (``Activation.interleaved``: row 2j gate j, row 2j + 1 up j; else gate rows then up rows), (E, N,
    K) for a *_no_mul one; alpha and limit are runtime floats (a new value compiles nothing).
    ``scales`` a ``WeightScales``: ``w`` holds low-bit codes, dequantized in the K loop. ``pre_out``
    (gated, Standard routing; (num_slots, N_w) contiguous, x's dtype): the epilogue also stores each
    slot's pre-activation there (``moe_epilogue``'s SAVE_PRE), gate columns then up columns.
    ``lora`` (Standard routing, float operands): the epilogue adds ``lora.scale * t @ B[e].T`` to
    x @ W[e].T (``LoraOperands``; several stacked adapters: each slot's own). Shapes were checked by the caller. Planned: the body runs once per static signature of the arguments."""
    act_args = (activation or Activation()).kernel_args() if gated else NO_ACTIVATION_ARGS
    mul = act_args["MUL"]
    n, k = out.shape[-1], a.shape[-1]
    rows = route.gemm_rows
    if rows not in (Route.SORTED, Route.SLOTS, Route.BATCHED):
        raise ValueError(f"invoke_moe_gemm runs the SORTED, SLOTS, DIRECT and BATCHED routes, not {route.name}")
    batched = rows is Route.BATCHED
    unused = w  # pointer arguments the route does not read
    route_args = dict(ROUTE=int(rows), sorted_ids_ptr=unused, expert_ids_ptr=unused, num_post_padded_ptr=unused,
                      expert_num_tokens_ptr=unused, topk_ids_ptr=unused, expert_map_ptr=unused, num_experts=0,
                      num_local_experts=w.shape[0], HAS_MAP=False, stride_ae=0, stride_oe=0, blocks_per_expert=1)
    if batched:
        cap = a.shape[1]
        route_args.update(blocks_per_expert=cdiv(cap, config.block_m), num_slots=0, a_row_div=1,
                          expert_num_tokens_ptr=expert_num_tokens, stride_ae=a.stride(0), stride_oe=out.stride(0))
        num_pid_m = w.shape[0] * route_args["blocks_per_expert"]
    elif rows is Route.SLOTS:
        num_pid_m = routing.topk_ids.numel()
        route_args.update(topk_ids_ptr=routing.topk_ids, num_experts=routing.num_experts, num_slots=num_pid_m,
                          a_row_div=routing.a_row_div, HAS_MAP=routing.expert_map is not None,
                          expert_map_ptr=routing.expert_map if routing.expert_map is not None else unused)
    else:
        num_pid_m = routing.expert_ids.shape[0]
        route_args.update(sorted_ids_ptr=routing.sorted_token_ids, expert_ids_ptr=routing.expert_ids,
                          num_post_padded_ptr=routing.num_tokens_post_padded, num_slots=routing.num_slots,
                          a_row_div=routing.a_row_div)
    if num_pid_m == 0 or n == 0:
        return out
    config = fit_shared_memory(config, a.element_size(), mul,
                               shared_memory_budget(a.device) - persistent_epilogue_bytes(config, out.element_size()),
                               weight_bytes(scales, w))
    config = fit_low_bit(config, scales)
    if out_scale is not None:
        group_out = fused_quant_group(n, out_scale.shape[-1], config, gated)
        os_st = (out_scale.stride(0) if batched else 0, out_scale.stride(-2), out_scale.stride(-1))
    else:
        group_out, os_st = 1, (0, 0, 0)
    w_desc = None if act_args["INTERLEAVED"] else weight_descriptor(w, config)
    num_tiles = num_pid_m * cdiv(n, config.block_n)
    persistent = config.persistent and w_desc is not None and rows is Route.SORTED
    grid = (persistent_programs(a.device, num_tiles) if persistent else num_tiles,)
    kwargs = dict(
        a_ptr=a, w_ptr=w, out_ptr=out, W_DESC=w_desc is not None,
        UNIFORM_W_SCALE=w_desc is not None and uniform_w_scale(scales, n, config.block_n, mul),
        topk_weights_ptr=topk_weights if topk_weights is not None else w,
        bias_ptr=bias if bias is not None else w, stride_be=bias.stride(0) if bias is not None else 0,
        HAS_BIAS=bias is not None,
        out_scale_ptr=out_scale if out_scale is not None else w, stride_ose=os_st[0], stride_osm=os_st[1],
        stride_osg=os_st[2], quant_eps=quant_eps, QUANT_OUT=out_scale is not None, GROUP_OUT=group_out,
        N=n, K=k, num_pid_m=num_pid_m,
        stride_am=a.stride(-2), stride_ak=a.stride(-1),
        stride_we=w.stride(0), stride_wn=w.stride(1), stride_wk=w.stride(2),
        stride_om=out.stride(-2), stride_on=out.stride(-1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        GATED=gated, **act_args, MUL_ROUTED_WEIGHT=topk_weights is not None,
        EVEN_K=k % config.block_k == 0, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, SWAP_AB=config.swap_ab, PERSISTENT=persistent,
        HALVES=up_in_halves(w, mul, act_args["INTERLEAVED"]),
        pre_ptr=pre_out if pre_out is not None else w, stride_pm=pre_out.stride(0) if pre_out is not None else 0,
        SAVE_PRE=pre_out is not None, **lora_args(lora, w, batched), **lora_adapter_args(lora, w),
        **route_args, **scale_args(scales, a, w, config, config.block_n * (1 + mul), batched=batched), **pdl_args(),
    )
    if w_desc is not None:  # a descriptor is built per call: launched here, not planned
        launch(_moe_gemm_kernel, grid, **{**kwargs, "w_ptr": w_desc})
        return out
    return Launch(_moe_gemm_kernel, grid, kwargs, out)

