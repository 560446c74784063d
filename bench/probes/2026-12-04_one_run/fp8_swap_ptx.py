"""Compile (sm_90, no GPU) the fp8 block-quantized GEMMs of a Qwen3-30B-A3B decode step (M=1,
slots route) with the shipped decode tile (16 x 128 x 128, 4 warps) and with a swap_ab tile
(16 x 64 x 128), and count what the K loop is made of: mma.sync vs wgmma, fp8 -> fp16
conversions, registers (ptxas, from the cubin). usage: TRITON_INTERPRET=0 PYTHONPATH=. python fp8_swap_ptx.py"""
import re

import torch
import triton

from tmoe.testing.sm90 import compile_only_sm90, sass

seen = []
compile_only_sm90(lambda name, kwargs, kernel: seen.append((name, kwargs, kernel)))

import tmoe  # noqa: E402
from tmoe.testing.strategies import MoEShape, make_problem  # noqa: E402

FP8 = torch.float8_e4m3fn


def registers(cubin: bytes) -> str:
    return re.search(r"REG:\d+", sass(cubin)).group(0)


p = make_problem(MoEShape(1, 8, 768, 2048, 8), torch.bfloat16, "uniform", seed=0)  # 8 experts stand in for 128
e, n2, k = p.w1.shape
fp8 = dict(quant_config=tmoe.FusedMoEQuantConfig(FP8, block_shape=(128, 128)),
           w1_scale=torch.ones(e, n2 // 128, k // 128), w2_scale=torch.ones(e, k // 128, n2 // 2 // 128))
print(f"triton {triton.__version__}")
for swap in (False, True):
    seen.clear()
    cfg = tmoe.GemmConfig(16, 64 if swap else 128, 128, 8, 4, 4, swap_ab=swap)
    with tmoe.override_route("slots"), tmoe.override_config(tmoe.MoEConfig(cfg, cfg)):
        tmoe.fused_experts(p.x, p.w1.to(FP8), p.w2.to(FP8), p.topk_weights, p.topk_ids, **fp8)
    for name, kwargs, kernel in seen:
        if name != "_moe_gemm_kernel":
            continue
        ptx = kernel.asm["ptx"]
        print(f"{'swap_ab' if swap else 'shipped'} {'up  ' if kwargs['GATED'] else 'down'} {cfg.block_m}x{cfg.block_n}x"
              f"{cfg.block_k}: mma.sync {ptx.count('mma.sync')}, wgmma {ptx.count('wgmma.mma_async')} "
              f"(e4m3 operands: {len(re.findall(r'wgmma[^;]*e4m3', ptx))}), cvt e4m3x2->f16x2 "
              f"{len(re.findall(r'cvt[.]rn[.]f16x2[.]e4m3x2', ptx))}, {registers(kernel.asm['cubin'])}, "
              f"shared {kernel.metadata.shared} B")
