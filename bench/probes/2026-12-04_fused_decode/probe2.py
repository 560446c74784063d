"""(1) The fused decode kernel's tiles, bf16, whole layer, graph replay (mean of two routings):
block_n x the down step's column chunk (DOWN_TILE weight elements per step) x warps, against the
default route, at Qwen3-30B-A3B M = 1, 2, 4 and DeepSeek-V3 / Mixtral M = 1.
(2) GPT-OSS shapes (no table), mxfp4 group 32: the heuristic (block_k dividing K: 64) against
block_k 32 (the heuristic before 2026-12-04) and 128 (7a3b0ba's), and block_n 32 at M = 1; bf16
block_k 64 against its heuristic's (128 at M <= 16)."""
from dataclasses import replace

import torch
import triton

import tmoe
import tmoe.kernels.moe_fused_decode as fused_decode
from tmoe.config import GemmConfig as G, MoEConfig, get_config, override_config, override_route
from tmoe.kernels.launch import clear_launch_caches
from tmoe.tools.low_bit import quantize
from tmoe.tools.tune import SHAPES


def bench(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3


def routing(m, e, topk):
    w, ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
    return w, ids.int()


for name, ms in (("qwen3", (1, 2, 4)), ("deepseek", (1,)), ("mixtral", (1,))):
    e, n, k, topk = SHAPES[name]
    w1 = (torch.randn(e, 2 * n, k, device="cuda") / k ** 0.5).bfloat16()
    w2 = (torch.randn(e, k, n, device="cuda") / n ** 0.5).bfloat16()
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        times: dict[str, list[float]] = {}
        for trial in range(2):
            w, ids = routing(m, e, topk)
            fn = lambda: tmoe.fused_experts(x, w1, w2, w, ids)  # noqa: E731
            times.setdefault("default", []).append(bench(fn))
            for tile in (4096, 16384, 32768):
                fused_decode.DOWN_TILE = tile
                clear_launch_caches()
                for bn in (32, 64, 128):
                    for warps in (4, 8):
                        cfg = G(16, bn, 128, num_warps=warps, num_stages=4)
                        with override_config(MoEConfig(cfg, cfg)), override_route("fused"):
                            times.setdefault(f"{bn}/{tile}/w{warps}", []).append(bench(fn))
        best = min((c for c in times if c != "default"), key=lambda c: sum(times[c]))
        print(f"{name} bf16 M={m} default {sum(times['default']) / 2:.1f} best fused {best} {sum(times[best]) / 2:.1f} | "
              + "  ".join(f"{c} {sum(t) / len(t):.1f}" for c, t in times.items()), flush=True)
    del w1, w2
    torch.cuda.empty_cache()
fused_decode.DOWN_TILE = 8192
clear_launch_caches()

for name, (e, n, k, topk) in {"gpt-oss-20b": (32, 2880, 2880, 4), "gpt-oss-120b": (128, 2880, 2880, 4)}.items():
    w1 = (torch.randn(e, 2 * n, k, device="cuda") / k ** 0.5).bfloat16()
    w2 = (torch.randn(e, k, n, device="cuda") / n ** 0.5).bfloat16()
    (q1, s1, _), (q2, s2, _) = quantize(w1, "mxfp4"), quantize(w2, "mxfp4")
    qc = tmoe.FusedMoEQuantConfig(weight_dtype="mxfp4", group_size=32)
    for m in (1, 8, 64, 256, 1024):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w, ids = routing(m, e, topk)
        heur = get_config(m, e, n, k, topk, x.device, quant=qc.quant_name, group_size=32)
        fn = lambda: tmoe.fused_experts(x, q1, q2, w, ids, quant_config=qc, w1_scale=s1, w2_scale=s2)  # noqa: E731
        line = [("heuristic", bench(fn))]
        variants = [(f"bk{bk}", MoEConfig(replace(heur.up, block_k=bk), replace(heur.down, block_k=bk))) for bk in (32, 128)]
        if m == 1:
            variants += [(f"bn32 bk{bk}", MoEConfig(replace(heur.up, block_n=32, block_k=bk),
                                                    replace(heur.down, block_n=32, block_k=bk))) for bk in (64, 128)]
            variants += [("w8", MoEConfig(replace(heur.up, num_warps=8), replace(heur.down, num_warps=8)))]
        for label, cfg in variants:
            with override_config(cfg):
                line.append((label, bench(fn)))
        bf_heur = get_config(m, e, n, k, topk, x.device)
        bf = [("bf16", bench(lambda: tmoe.fused_experts(x, w1, w2, w, ids)))]
        if m <= 64:
            with override_config(MoEConfig(replace(bf_heur.up, block_k=64), replace(bf_heur.down, block_k=64))):
                bf.append(("bf16 bk64", bench(lambda: tmoe.fused_experts(x, w1, w2, w, ids))))
        h = heur.up
        print(f"{name} M={m:5d} mxfp4 heuristic {h.block_m}x{h.block_n}x{h.block_k}/{heur.down.block_n}x"
              f"{heur.down.block_k}w{h.num_warps}s{h.num_stages} | " + "  ".join(f"{c} {us:.1f}" for c, us in line)
              + f" | bf16 heuristic bk {bf_heur.up.block_k}/{bf_heur.down.block_k}: "
              + "  ".join(f"{c} {us:.1f}" for c, us in bf), flush=True)
    del w1, w2, q1, q2
    torch.cuda.empty_cache()
