"""Compile (sm_90, no GPU) the fp8 block layer's two GEMMs with the Mixtral-8x7B M=1024 tiles of the
shipped table (block_m 64, TMA weights) in the tree on PYTHONPATH and print each kernel's registers,
shared memory and a hash of its SASS, so two trees can be compared (did the kernels change, or only
the run?). Self-contained: older trees have no tmoe.testing.sm90.

    TRITON_INTERPRET=0 PYTHONPATH=TREE python bench/probes/2026-12-05_fp8/same_sass.py
"""
import hashlib
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

import tmoe
from tmoe.tools.peers import quantize_fp8

seen = []


class Sm90(CudaDriver):
    def __init__(self):
        self.get_current_device = lambda: 0
        self.get_current_stream = lambda device=None: 0
        self.get_device_capability = lambda device=None: (9, 0)

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(Sm90())
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    seen.append((self.fn.__name__, kernel))
    return kernel


JITFunction.run = _compile_only


def sass(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "--dump-resource-usage", "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


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
    text = sass(kernel.asm["cubin"])
    body = "\n".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", line) for line in text.splitlines() if "/*" in line)
    print(name, re.search(r"REG:\d+", text).group(0), "smem", kernel.metadata.shared,
          "sass lines", body.count("\n") + 1, "sha1", hashlib.sha1(body.encode()).hexdigest()[:12])
