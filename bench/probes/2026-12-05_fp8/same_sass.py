"""Compile (sm_90, no GPU) the fp8 block layer's two GEMMs with the Mixtral-8x7B M=1024 tiles of the
shipped table (block_m 64, TMA weights) in the tree on PYTHONPATH and print each kernel's registers,
shared memory and a hash of its SASS, so two trees can be compared (did the kernels change, or only
the run?).

    TRITON_INTERPRET=0 PYTHONPATH=TREE python bench/probes/2026-12-05_fp8/same_sass.py
"""
import hashlib
import importlib.util
import re
from pathlib import Path

import torch

import tmoe
from tmoe.tools.peers import quantize_fp8

# this repo's tmoe/testing/sm90.py, loaded by path (it needs only triton): the tree on PYTHONPATH may
# predate it
_spec = importlib.util.spec_from_file_location("sm90", Path(__file__).resolve().parents[3] / "tmoe/testing/sm90.py")
sm90 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sm90)
seen = []
sm90.compile_only_sm90(lambda name, kwargs, kernel: seen.append((name, kernel)))

e, n, k, m = 8, 512, 1024, 64
x = torch.randn(m, k, dtype=torch.bfloat16)
w, ids = torch.topk(torch.randn(m, e).softmax(-1), 2)
(w1, s1), (w2, s2) = (quantize_fp8(torch.randn(e, 2 * n, k, dtype=torch.bfloat16), "fp8_block"),
                      quantize_fp8(torch.randn(e, k, n, dtype=torch.bfloat16), "fp8_block"))
qc = tmoe.FusedMoEQuantConfig(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
up = tmoe.GemmConfig(64, 64, 128, 8, 4, 4, tma=True)
down = tmoe.GemmConfig(64, 128, 128, 8, 8, 3, tma=True)
with tmoe.override_route("sorted"), tmoe.override_config(tmoe.MoEConfig(up, down)):
    tmoe.fused_experts(x, w1, w2, w, ids, quant_config=qc, w1_scale=s1, w2_scale=s2)
for name, kernel in seen:
    if name != "_moe_gemm_kernel":
        continue
    text = sm90.sass(kernel.asm["cubin"])
    body = "\n".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", line) for line in text.splitlines() if "/*" in line)
    print(name, re.search(r"REG:\d+", text).group(0), "smem", kernel.metadata.shared,
          "sass lines", body.count("\n") + 1, "sha1", hashlib.sha1(body.encode()).hexdigest()[:12])
