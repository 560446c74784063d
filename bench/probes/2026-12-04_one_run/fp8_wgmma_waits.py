"""Compile (sm_90, no GPU) the fp8 GEMMs of an aligned layer (E=8, N=2048, K=1024, M=256, top-8) with
block 128x128 scales and with per-token/per-channel scales, pointer and TMA weight tiles, 64x64 (4
warps) and 128x128 (8 warps), and print the wgmma.wait_group depths in each kernel's PTX: 0 inside the
K loop means no MMA of one step overlaps the next.
usage: TRITON_INTERPRET=0 PYTHONPATH=. python fp8_wgmma_waits.py"""
import re

import torch
import triton

from tmoe.testing.sm90 import compile_only_sm90

seen = []
compile_only_sm90(lambda name, kwargs, kernel: seen.append((name, kwargs, kernel)))

import tmoe  # noqa: E402
from tmoe.testing.strategies import MoEShape, make_problem  # noqa: E402

FP8 = torch.float8_e4m3fn
p = make_problem(MoEShape(256, 8, 2048, 1024, 8), torch.bfloat16, "uniform", seed=0)
e, n2, k = p.w1.shape
SCHEMES = {
    "block": dict(quant_config=tmoe.FusedMoEQuantConfig(FP8, block_shape=(128, 128)),
                  w1_scale=torch.ones(e, n2 // 128, k // 128), w2_scale=torch.ones(e, k // 128, n2 // 2 // 128)),
    "per-token": dict(quant_config=tmoe.FusedMoEQuantConfig(FP8, per_act_token_quant=True, per_out_ch_quant=True),
                      w1_scale=torch.ones(e, n2), w2_scale=torch.ones(e, k)),
}
print(f"triton {triton.__version__}")
for scheme, fp8 in SCHEMES.items():
    for tma in (False, True):
        for bm, bn, warps in ((64, 64, 4), (128, 128, 8)):
            seen.clear()
            cfg = tmoe.GemmConfig(bm, bn, 128, 8, warps, 4, tma=tma)
            with tmoe.override_route("sorted"), tmoe.override_config(tmoe.MoEConfig(cfg, cfg)):
                tmoe.fused_experts(p.x, p.w1.to(FP8), p.w2.to(FP8), p.topk_weights, p.topk_ids, **fp8)
            for name, kwargs, kernel in seen:
                if name != "_moe_gemm_kernel":
                    continue
                ptx = kernel.asm["ptx"]
                waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
                gemm = "up  " if kwargs["GATED"] else "down"
                print(f"{scheme:9} {'tma' if tma else 'ptr'} {bm}x{bn} {warps} warps {gemm}:"
                      f" wgmma {ptx.count('wgmma.mma_async')}, wait_group depths in order {waits}")
