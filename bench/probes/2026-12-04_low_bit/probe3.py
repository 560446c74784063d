"""A: Qwen3 int4 M=1 whole layer (slots route) over up/down tiles, beside bf16. B: Mixtral
M=256 int4/mxfp4 GEMMs (sorted route, block_m 64) over 8-warp and swap_ab variants."""
import itertools
import time

import torch
import triton

import tmoe
from tmoe.config import GemmConfig as G, MoEConfig, override_config
from tmoe.tools.low_bit import quantize
from tmoe.tools.tune import SHAPES, make_problem, _gemm_runs, _fastest

t0 = time.time()
e, n, k, topk = SHAPES["qwen3"]
w1 = (torch.randn(e, 2 * n, k, device="cuda") / k ** 0.5).bfloat16()
w2 = (torch.randn(e, k, n, device="cuda") / n ** 0.5).bfloat16()
for scheme in ("int4",):
    (q1, s1, z1), (q2, s2, z2) = quantize(w1, scheme), quantize(w2, scheme)
    qc = tmoe.FusedMoEQuantConfig(weight_dtype=scheme, group_size=128)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    res = []
    for trial in range(2):
        w, ids = torch.topk(torch.randn(1, e, device="cuda").softmax(-1), topk)
        ids = ids.int()
        bf = triton.testing.do_bench_cudagraph(lambda: tmoe.fused_experts(x, w1, w2, w, ids), rep=50) * 1e3
        auto = triton.testing.do_bench_cudagraph(lambda: tmoe.fused_experts(
            x, q1, q2, w, ids, quant_config=qc, w1_scale=s1, w2_scale=s2, w1_zp=z1, w2_zp=z2), rep=50) * 1e3
        print(f"qwen3 M=1 trial {trial}: bf16 {bf:.1f} us  {scheme} table {auto:.1f} us", flush=True)
    ups = [G(16, bn, 128, 8, 4, s) for bn in (16, 32, 64) for s in (3, 4)]
    downs = [G(16, bn, 128, 8, 4, s) for bn, s in ((64, 3), (32, 4), (128, 3), (16, 4))]
    for up, down in itertools.product(ups, downs):
        with override_config(MoEConfig(up, down)):
            fn = lambda: tmoe.fused_experts(x, q1, q2, w, ids, quant_config=qc, w1_scale=s1, w2_scale=s2,  # noqa
                                            w1_zp=z1, w2_zp=z2)
            fn()
            us = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
        res.append((us, up, down))
        print(f"  up {up.block_n}x{up.block_k}s{up.num_stages} down {down.block_n}x{down.block_k}s{down.num_stages}: {us:.1f}",
              flush=True)
    best = min(res, key=lambda r: r[0])
    print(f"qwen3 {scheme} M=1 best {best[0]:.1f} us up={best[1]} down={best[2]}", flush=True)
del w1, w2
torch.cuda.empty_cache()
e, n, k, topk = SHAPES["mixtral"]
for scheme in ("int4", "mxfp4"):
    p = make_problem(e, n, k, topk, torch.bfloat16, scheme)
    up, down = _gemm_runs(256, p, 64)
    base = {"int4": (G(64, 64, 128, 8, 4, 3, swap_ab=True), G(64, 128, 64, 8, 4, 4, swap_ab=True)),
            "mxfp4": (G(64, 64, 128, 8, 4, 3), G(64, 64, 128, 8, 4, 3))}[scheme]
    shared = [G(64, 64, 128, 8, 8, 3, swap_ab=True), G(64, 64, 128, 8, 8, 4, swap_ab=True),
              G(64, 64, 64, 8, 8, 5, swap_ab=True), G(64, 64, 64, 8, 8, 4, swap_ab=True),
              G(64, 128, 64, 8, 8, 4, swap_ab=True), G(64, 128, 128, 8, 8, 3, swap_ab=True),
              G(64, 64, 128, 8, 8, 4), G(64, 64, 64, 8, 8, 4)]
    for name, own, run in (("up", base[0], up), ("down", base[1], down)):
        line = []
        for cfg in [own] + shared:
            us, _ = _fastest([cfg], run)
            line.append((us, cfg))
            print(f"  mixtral {scheme} M=256 {name} {cfg.block_m}x{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}"
                  f"{' swap' if cfg.swap_ab else ''}: {us:.1f}", flush=True)
        best = min(line, key=lambda r: r[0])
        print(f"mixtral {scheme} M=256 {name} base {line[0][0]:.1f} best {best[0]:.1f} {best[1]}", flush=True)
    del p
    torch.cuda.empty_cache()
print(f"done {time.time() - t0:.0f} s")
