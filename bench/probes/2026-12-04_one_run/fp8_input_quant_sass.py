"""SASS size and registers of the Qwen3-30B-A3B fp8-block decode up GEMM (M=1, direct routing),
compile-only for sm_90: fp8 A (quantized by the quant stage) against bf16 A, with the shipped
decode tile and a swap_ab one. bf16 A compiles only with the prototype patch recorded in
bench/results/2026-12-04_fp8_fused_input_quant_sm90.log applied (each K step quantizing its A tile).
usage: TRITON_INTERPRET=0 PYTHONPATH=. python fp8_input_quant_sass.py"""
import re

import torch

from tmoe.testing.sm90 import compile_only_sm90, sass

seen = []
compile_only_sm90(lambda name, kwargs, kernel: seen.append((name, kwargs, kernel)))

import tmoe  # noqa: E402
from tmoe.kernels.gemm_args import DirectRouting, Scales  # noqa: E402
from tmoe.kernels.moe_gemm import invoke_moe_gemm  # noqa: E402

FP8 = torch.float8_e4m3fn


e, n, k, topk, m = 8, 768, 2048, 8, 1
w1 = torch.randn(e, 2 * n, k).to(FP8)
s1 = torch.ones(e, 2 * n // 128, k // 128)
ids = torch.randint(0, e, (m, topk), dtype=torch.int32)
for swap in (False, True):
    for a_dtype in ("fp8", "bf16"):
        seen.clear()
        x = torch.randn(m, k, dtype=torch.bfloat16)
        a = x.to(FP8) if a_dtype == "fp8" else x
        cfg = tmoe.GemmConfig(16, 64 if swap else 128, 128, 8, 4, 4, swap_ab=swap)
        out = torch.empty(m * topk, n, dtype=torch.bfloat16)
        try:
            invoke_moe_gemm(a, w1, out, cfg, gated=True, routing=DirectRouting(ids, e, None, topk),
                            scales=Scales(torch.ones(m, k // 128), s1, (128, 128)))
        except Exception as err:  # noqa: BLE001  (bf16 A without the prototype patch)
            print("swap" if swap else "plain", a_dtype, f"does not compile: {type(err).__name__}")
        for name, _, kernel in seen:
            if name != "_moe_gemm_kernel":
                continue
            text = sass(kernel.asm["cubin"])
            instrs = [line for line in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
            count = lambda op: sum(op in line for line in instrs)  # noqa: E731
            print("swap" if swap else "plain", a_dtype, re.search(r"REG:\d+", text).group(0), "sass instrs",
                  len(instrs), "F2FP", count("F2FP"), "HMMA", count("HMMA"), "SHFL", count("SHFL"), "BAR", count("BAR"))
