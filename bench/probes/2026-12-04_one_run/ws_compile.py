"""Does tl.range(warp_specialize=True) compile for sm_90 (compile-only, on the CPU) with pointer-loaded A
and TMA B (as the expert GEMM loads them), and with both operands through TMA descriptors?

    TRITON_INTERPRET=0 python bench/probes/2026-12-04_one_run/ws_compile.py  (under each Triton)
"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from tmoe.testing.sm90 import compile_only_sm90

seen = {}
compile_only_sm90(lambda name, kw, k: seen.setdefault(name, k))

@triton.jit
def k_ptr_a(a_ptr, w_desc, out_ptr, K, stride_am, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            WS: tl.constexpr, A_DESC: tl.constexpr):
    acc = tl.zeros((BM, BN), tl.float32)
    rows = tl.arange(0, BM)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + tl.arange(0, BK)[None, :]
    for k in tl.range(0, tl.cdiv(K, BK), warp_specialize=WS):
        a = tl.load(a_ptrs)
        b = w_desc.load([0, 0, k * BK]).reshape(BN, BK).T
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
    tl.store(out_ptr + rows[:, None] * BN + tl.arange(0, BN)[None, :], acc.to(tl.bfloat16))

a = torch.empty(256, 1024, dtype=torch.bfloat16)
w = torch.empty(2, 256, 1024, dtype=torch.bfloat16)
out = torch.empty(128, 128, dtype=torch.bfloat16)
for ws in (False, True):
    for warps in (4, 8):
        desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [1, 128, 64])
        try:
            seen.clear()
            k_ptr_a[(1,)](a, desc, out, 1024, 1024, BM=128, BN=128, BK=64, WS=ws, A_DESC=False, num_warps=warps, num_stages=3)
            ck = seen["k_ptr_a"]
            ptx = ck.asm["ptx"]
            print(triton.__version__, "ws", ws, "warps", warps, "ok; wgmma", ptx.count("wgmma.mma_async"),
                  "setmaxnreg", ptx.count("setmaxnreg"), "ttg.ws", ck.asm["ttgir"].count("warp_specialize"), "partitions", ck.asm["ttgir"].count("partition"))
        except Exception as e:
            print(triton.__version__, "ws", ws, "warps", warps, "FAIL", type(e).__name__, str(e).splitlines()[-1][:200])

@triton.jit
def k_desc(a_desc, w_desc, out_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr):
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, tl.cdiv(K, BK), warp_specialize=WS):
        a = a_desc.load([0, k * BK])
        b = w_desc.load([0, 0, k * BK]).reshape(BN, BK).T
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], acc.to(tl.bfloat16))

for ws in (False, True):
    for warps in (4, 8):
        adesc = TensorDescriptor(a, list(a.shape), list(a.stride()), [128, 64])
        desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [1, 128, 64])
        try:
            seen.clear()
            k_desc[(1,)](adesc, desc, out, 1024, BM=128, BN=128, BK=64, WS=ws, num_warps=warps, num_stages=3)
            ck = seen["k_desc"]; ptx = ck.asm["ptx"]
            print(triton.__version__, "desc ws", ws, "warps", warps, "ok; wgmma", ptx.count("wgmma.mma_async"),
                  "setmaxnreg", ptx.count("setmaxnreg"), "ttg.ws", ck.asm["ttgir"].count("warp_specialize"))
        except Exception as e:
            print(triton.__version__, "desc ws", ws, "warps", warps, "FAIL", type(e).__name__, str(e).splitlines()[-1][:200])
