"""The grouped-GEMM core: expert GEMMs over expert-sorted rows, both operands through TMA, persistent.

A holds the routed rows in the align stage's order (``sorted_rows``): each expert's run is padded
to ``block_m``, so each row block belongs to one expert and loads as one TMA tile, as do its weight
tiles. At most one program per SM walks the valid tiles (their count read from
num_tokens_post_padded) in grouped order: ``group_m`` row blocks sweep the column blocks together,
so an expert's weight tiles stream once per group. The down GEMM's tile loop is flattened (the
software pipeline issues the next tile's first loads during this tile's epilogue); the up GEMM's is
not (flattened, its two accumulators made it up to 1.3x slower on H100). The up GEMM (``gated``) writes its intermediate in sorted order (``SORTED_OUT``),
which the down GEMM reads by TMA in turn; the down GEMM writes each slot's row where the slot is
(``sorted_token_ids``), so the top-k reduce reads (M, topk, K) as after the pointer-gathered route
(``moe_gemm``). The epilogues are that route's (``moe_epilogue``: activation, fused fp8 intermediate
quantization, router weight, biases). Rows are int64; padding rows are never stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tmoe.kernels._details.gemm_epilogue import moe_epilogue
from tmoe.kernels._details.tile_matmul import moe_tile_matmul_tma, tile_ids
from tmoe.kernels.activation import NO_ACTIVATION_ARGS, Activation
from tmoe.kernels.gemm_args import (
    fit_shared_memory, fused_quant_group, persistent_epilogue_bytes, scale_args, tma_addressable, uniform_w_scale, weight_descriptor,
)
from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels.lora import LoraOperands, lora_args
from tmoe.kernels.operands import Routing, Scales
from tmoe.kernels.sizes import cdiv
from tmoe.runtime.device import persistent_programs, shared_memory_budget, sm_count
from tmoe.runtime.gluon import gluon_ready
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.launch import launch
from tmoe.runtime.pdl import pdl_args, pdl_launch_dependents, pdl_wait

try:  # the warp-specialized engine; where this Triton's Gluon API differs, the tl core runs everywhere
    from tmoe.kernels import gluon_grouped
except (ImportError, AttributeError, TypeError):
    gluon_grouped = None


@triton.jit(do_not_specialize=['num_slots'])
def _grouped_gemm_kernel(
    a_desc,  # [EM, K] TMA descriptor, block [BM, BK]: rows in sorted order
    w_desc,  # [E, N_w, K] TMA descriptor, block [1, BN, BK]: N_w = 2N when MUL (gate rows, then up rows)
    out_ptr,  # SORTED_OUT: [EM, N] (row p of the tile loop); else [num_slots, N] (row sorted_ids[p])
    a_scale_ptr,  # [EM, K // GROUP_K] float32, sorted rows (zero strides: one per-tensor scale)
    w_scale_ptr,  # [E, N_w // GROUP_N, K // GROUP_K] float32
    topk_weights_ptr,  # [num_slots] float32 (MUL_ROUTED_WEIGHT)
    bias_ptr,  # [E, N_w] (HAS_BIAS)
    sorted_ids_ptr,  # [EM] int32
    expert_ids_ptr,  # [EM // BLOCK_M] int32
    num_post_padded_ptr,  # [1] int32
    out_scale_ptr,  # QUANT_OUT: [EM, cdiv(N, GROUP_OUT)] float32, sorted rows
    pre_ptr,  # SAVE_PRE (gated): [num_slots, N_w] the pre-activation, row = slot
    lora_u_ptr,  # LORA: [EM, rank] t = a @ A[e].T of each sorted row
    lora_b_ptr,  # LORA: [E, N_w, rank] B, W's LoRA factor
    lora_rank, stride_lum, stride_lbe, stride_lbn, stride_lbr, lora_scale,
    N, K, num_slots,
    stride_om, stride_on, stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_be,
    stride_osm, stride_osg, stride_pm, quant_eps, act_alpha, act_limit,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATED: tl.constexpr, MUL: tl.constexpr, INTERLEAVED: tl.constexpr, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr,
    QUANT: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    QUANT_OUT: tl.constexpr, GROUP_OUT: tl.constexpr, SORTED_OUT: tl.constexpr,
    UNIFORM_W_SCALE: tl.constexpr, PRECISION: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr, USE_PDL: tl.constexpr, SAVE_PRE: tl.constexpr, LORA: tl.constexpr,
    LORA_R: tl.constexpr,
):
    pdl_wait(USE_PDL)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_valid_m = tl.load(num_post_padded_ptr) // BLOCK_M
    for tile in tl.range(tl.program_id(0), num_valid_m * num_pid_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = tile_ids(tile, num_valid_m, num_pid_n, GROUP_M)
        expert = tl.load(expert_ids_ptr + pid_m)
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] sorted rows
        every_row = tl.full((BLOCK_M,), 1, tl.int1)  # the sorted rows (and their scales) are all addressable
        acc, up = moe_tile_matmul_tma(
            a_desc, w_desc, pid_m * BLOCK_M, every_row, expert, pid_n * BLOCK_N, N + pid_n * BLOCK_N, N * (1 + MUL),
            a_scale_ptr + rows * stride_asm, w_scale_ptr + expert.to(tl.int64) * stride_wse,
            K, 0, stride_ask, stride_wsn, stride_wsk,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N, GROUP_K, QUANT, MUL, UNIFORM_W_SCALE, True, PRECISION, A_DESC=True,
        )  # [BM, BN] float32 each (up: MUL only)
        slots = tl.load(sorted_ids_ptr + rows).to(tl.int64)  # [BM]
        mask_m = slots < num_slots
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        if SORTED_OUT:
            out_rows = rows
        else:
            out_rows = tl.where(mask_m, slots, 0)
        bias_ptrs = bias_ptr + expert.to(tl.int64) * stride_be + offs_n  # [BN]
        moe_epilogue(acc, up, out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on, mask_m,
                     offs_n < N, offs_n, slots, bias_ptrs, topk_weights_ptr, out_scale_ptr + rows * stride_osm,
                     pre_ptr + tl.where(mask_m, slots, 0) * stride_pm, pid_n, N, stride_osg, quant_eps, act_alpha,
                     act_limit, BLOCK_M, BLOCK_N, GATED, MUL, INTERLEAVED, ACTIVATION, CLAMP, MUL_ROUTED_WEIGHT,
                     HAS_BIAS, QUANT_OUT, GROUP_OUT, SAVE_PRE, lora_u_ptr + rows * stride_lum,
                     lora_b_ptr + expert.to(tl.int64) * stride_lbe, lora_rank, stride_lbn, stride_lbr, lora_scale,
                     sorted_ids_ptr + rows, 1, 0, LORA, LORA_R, False, PRECISION)
    pdl_launch_dependents(USE_PDL)


def grouped_operands_fit(w: torch.Tensor, interleaved: bool = False) -> bool:
    """Whether the grouped core can read weights ``w`` (E, N_w, K) (float or fp8; the caller rules
    out low-bit codes): TMA can address them (K contiguous), gate and up halves not interleaved."""
    return not interleaved and tma_addressable(w)


def rows_descriptor(a: torch.Tensor, config: GemmConfig) -> TensorDescriptor:
    """The TMA descriptor of expert-sorted rows ``a`` (EM, K), block [block_m, block_k]."""
    return TensorDescriptor(a, list(a.shape), list(a.stride()), [config.block_m, config.block_k])


@with_interpreter_fixes
def invoke_grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    config: GemmConfig,
    routing: Routing,
    *,
    gated: bool,
    activation: Activation | None = None,
    topk_weights: torch.Tensor | None = None,
    scales: Scales | None = None,
    bias: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    quant_eps: float = 1e-10,
    pre_out: torch.Tensor | None = None,
    lora: LoraOperands | None = None,
) -> torch.Tensor:
    """One expert GEMM on the grouped core. ``a`` (EM, K): expert-sorted rows (``sorted_rows``;
    EM = len(routing.sorted_token_ids)), ``w`` (E, N_w, K) with ``grouped_operands_fit``. ``gated``
    (the up GEMM): ``out`` (EM, N) in sorted order, N the intermediate size, ``out_scale`` (EM, N / g) with fp8 ``out``
    (epilogue quantization, as ``invoke_moe_gemm``); else ``out`` (num_slots, N), row = slot.
    ``scales``: fp8 (``Scales``) with the activation scales in sorted rows. ``topk_weights``
    ([num_slots] float32) multiplies each slot's accumulator; ``bias`` (E, N_w). ``config``: tiles
    (``persistent`` and ``tma`` implied; stages and block_k fitted to shared memory). ``pre_out``
    (gated; (num_slots, N_w) contiguous): each slot's pre-activation is stored there too, as
    ``invoke_moe_gemm``'s. ``lora``: the epilogue adds ``lora.scale * u[row] @ B[e].T`` (u (EM, r)
    in sorted-row order, ``tmoe.kernels.lora``). Shapes were checked by the caller. On Hopper, where ``tmoe.runtime.gluon``
    wants it (by default the float up GEMM of enough rows per expert), all but block scales and the fused output quantization run on
    the warp-specialized Gluon engine (``gluon_grouped``), the same math; else on this module's ``tl`` kernel."""
    if lora is not None and lora.adapters is not None:
        raise ValueError("the grouped core runs one LoRA adapter; several (token_adapters) run the sorted route")
    gemm = ("up" if gated else "down") + (".fp8" if scales is not None else "")
    if (gluon_grouped is not None and out_scale is None and lora is None
            and gluon_ready(a.device, gemm, routing.num_slots / max(w.shape[0], 1))
            and gluon_grouped.gluon_grouped_fits(a, w, out, config, activation, gated, scales)):
        return gluon_grouped.invoke_gluon_grouped_gemm(
            a, w, out, config, routing, sm_count(a.device), gated=gated, activation=activation,
            topk_weights=topk_weights, scales=scales, bias=bias, pre_out=pre_out)
    act_args = (activation or Activation()).kernel_args() if gated else NO_ACTIVATION_ARGS
    mul = act_args["MUL"]
    n, k = out.shape[-1], a.shape[-1]
    num_pid_m = routing.expert_ids.shape[0]
    if num_pid_m == 0 or n == 0:
        return out
    if out_scale is not None:
        group_out = fused_quant_group(n, out_scale.shape[-1], config, gated)
        os_st = (out_scale.stride(0), out_scale.stride(1))
    else:
        group_out, os_st = 1, (0, 0)
    config = fit_shared_memory(config, a.element_size(), mul,
                               shared_memory_budget(a.device) - persistent_epilogue_bytes(config, out.element_size()))
    programs = persistent_programs(a.device, num_pid_m * cdiv(n, config.block_n))
    w_desc = weight_descriptor(w, config)
    kw = dict(
        a_desc=rows_descriptor(a, config), w_desc=w_desc, out_ptr=out,
        topk_weights_ptr=topk_weights if topk_weights is not None else w,
        bias_ptr=bias if bias is not None else w, stride_be=bias.stride(0) if bias is not None else 0,
        HAS_BIAS=bias is not None,
        sorted_ids_ptr=routing.sorted_token_ids, expert_ids_ptr=routing.expert_ids,
        num_post_padded_ptr=routing.num_tokens_post_padded,
        out_scale_ptr=out_scale if out_scale is not None else w, stride_osm=os_st[0], stride_osg=os_st[1],
        quant_eps=quant_eps, QUANT_OUT=out_scale is not None, GROUP_OUT=group_out,
        N=n, K=k, num_slots=routing.num_slots, stride_om=out.stride(0), stride_on=out.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        GATED=gated, **act_args, MUL_ROUTED_WEIGHT=topk_weights is not None, SORTED_OUT=gated,
        UNIFORM_W_SCALE=uniform_w_scale(scales, n, config.block_n, mul),
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        NUM_PROGRAMS=programs, FLATTEN=not gated,
        pre_ptr=pre_out if pre_out is not None else w, stride_pm=pre_out.stride(0) if pre_out is not None else 0,
        SAVE_PRE=pre_out is not None, **lora_args(lora, w),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(),
    )
    sa = scale_args(scales, a, w, config, config.block_n * (1 + mul))
    kw.update({name: sa[name] for name in ("a_scale_ptr", "w_scale_ptr", "stride_asm", "stride_ask", "stride_wse",
                                            "stride_wsn", "stride_wsk", "GROUP_N", "GROUP_K", "QUANT")})
    launch(_grouped_gemm_kernel, (programs,), **kw)
    return out
