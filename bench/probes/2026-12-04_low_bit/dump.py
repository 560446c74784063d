"""Compile one GEMM for sm_90 (no GPU) and write its ttgir / ptx / cubin to dump_out/ for inspection
(registers: cuobjdump --dump-resource-usage dump_out/up.cubin; SASS: cuobjdump -sass).
usage: TRITON_INTERPRET=0 python dump.py bf16|int4|mxfp4 bm bn bk warps stages [swap] [zp] [down] [noasm]
(the 4-bit PTX unpacking is forced on unless noasm; down: the down GEMM instead of the up one)"""
import pathlib
import sys

import torch

import tmoe
from tmoe.kernels import gemm_args
from tmoe.testing.sm90 import compile_only_sm90

seen = []  # (kernel name, CompiledKernel) of each launch
compile_only_sm90(lambda name, kwargs, kernel: seen.append((name, kernel)))
scheme, bm, bn, bk, nw, ns = sys.argv[1], *map(int, sys.argv[2:7])
swap = "swap" in sys.argv[7:]
zp = "zp" in sys.argv[7:]
gemm_args.asm_unpack = lambda scales, a, config, tile_n: scheme != "int8" and "noasm" not in sys.argv
e, n, k = 4, 512, 1024
x = torch.randn(9, k, dtype=torch.bfloat16)
w, ids = torch.topk(torch.randn(9, e).softmax(-1), 2)
w1, w2 = torch.randn(e, 2 * n, k, dtype=torch.bfloat16), torch.randn(e, k, n, dtype=torch.bfloat16)
g = 32 if scheme == "mxfp4" else 128
if scheme == "mxfp4":
    (q1, s1), (q2, s2), z1, z2 = tmoe.quantize_weight_mxfp4(w1), tmoe.quantize_weight_mxfp4(w2), None, None
elif scheme == "bf16":
    q1, s1, z1, q2, s2, z2 = w1, None, None, w2, None, None
elif scheme == "int4":
    q1, s1, z1 = tmoe.quantize_weight_int4(w1, g, zero_point=zp)
    q2, s2, z2 = tmoe.quantize_weight_int4(w2, g, zero_point=zp)
qc = None if scheme == "bf16" else tmoe.FusedMoEQuantConfig(weight_dtype=scheme, group_size=g)
cfg = tmoe.GemmConfig(bm, bn, bk, 8, nw, ns, swap_ab=swap)
with tmoe.override_route("sorted"), tmoe.override_config(tmoe.MoEConfig(cfg, cfg)):
    tmoe.fused_experts(x, q1, q2, w, ids, quant_config=qc, w1_scale=s1, w2_scale=s2, w1_zp=z1, w2_zp=z2)
out = pathlib.Path("dump_out")  # in the working directory
out.mkdir(exist_ok=True)
gem = [kk for name, kk in seen if name == "_moe_gemm_kernel"]
up = gem[1] if "down" in sys.argv else gem[0]
for ext in ("ttgir", "ptx", "cubin"):
    data = up.asm[ext]
    (out / f"up.{ext}").write_bytes(data if isinstance(data, bytes) else data.encode())
print("smem", up.metadata.shared)
