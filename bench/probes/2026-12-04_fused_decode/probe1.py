"""The fused decode path (both GEMMs per (slot, intermediate block) in one kernel, then a reduce)
against the default route (M=1: slots; M>1: sorted), whole layer, CUDA-graph replay, mean of two
routings; at M=1 a sweep of the fused kernel's tiles (block_n x block_k, warps, stages).
Usage: python probe1.py [shape ...] (default: qwen3 mixtral deepseek)."""
import sys

import torch
import triton

import tmoe
from tmoe.config import GemmConfig as G, MoEConfig, fused_decode_config, override_config, override_route
from tmoe.tools.low_bit import quantize
from tmoe.tools.tune import SHAPES

SWEEP = [(bn, bk, w, s) for bn in (32, 64, 128) for bk, w, s in ((128, 4, 4), (256, 4, 3), (128, 8, 4))]


def bench(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3


for name in sys.argv[1:] or ("qwen3", "mixtral", "deepseek"):
    e, n, k, topk = SHAPES[name]
    w1 = (torch.randn(e, 2 * n, k, device="cuda") / k ** 0.5).bfloat16()
    w2 = (torch.randn(e, k, n, device="cuda") / n ** 0.5).bfloat16()
    schemes = {"bf16": (w1, w2, {})}
    for scheme, g in (("int4", 128), ("mxfp4", 32)):
        (q1, s1, z1), (q2, s2, z2) = quantize(w1, scheme), quantize(w2, scheme)
        schemes[scheme] = (q1, q2, dict(quant_config=tmoe.FusedMoEQuantConfig(weight_dtype=scheme, group_size=g),
                                        w1_scale=s1, w2_scale=s2, w1_zp=z1, w2_zp=z2))
    for scheme, (a, b, kw) in schemes.items():
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            times: dict[str, list[float]] = {}
            for trial in range(2):
                w, ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
                ids = ids.int()
                fn = lambda: tmoe.fused_experts(x, a, b, w, ids, **kw)  # noqa: E731
                ref = fn().float()
                times.setdefault("default", []).append(bench(fn))
                with override_route("fused"):
                    out = fn().float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    times.setdefault("fused", []).append(bench(fn))
                    if m == 1 and scheme != "mxfp4" and trial == 0:
                        for bn, bk, warps, stages in SWEEP:
                            cfg = G(16, bn, bk, num_warps=warps, num_stages=stages)
                            with override_config(MoEConfig(cfg, cfg)):
                                times[f"{bn}x{bk}w{warps}s{stages}"] = [bench(fn)]
            h = fused_decode_config(m, n, k, topk, x.device)
            print(f"{name} {scheme} M={m} heuristic {h.block_n}x{h.block_k}w{h.num_warps}s{h.num_stages} "
                  f"rel.err fused vs default {err:.1e} | "
                  + "  ".join(f"{c} {sum(t) / len(t):.1f}" for c, t in times.items()), flush=True)
    del w1, w2, schemes, q1, q2
    torch.cuda.empty_cache()
