"""The defaults as landed, whole layer, graph replay, mean of two routings: Qwen3-30B-A3B bf16 at
M = 1, 2, 4, 8 (the fused decode path at 2-4) against the route it replaced (M=1: slots, else
sorted); GPT-OSS mxfp4 at M = 1, 8 with the low-bit heuristic (block_k dividing K, decode
block_n filling the GPU) against bf16."""
import torch
import triton

import tmoe
from tmoe.config import get_config, override_route
from tmoe.tools.low_bit import quantize
from tmoe.tools.tune import SHAPES


def bench(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=40) * 1e3


def routing(m, e, topk):
    w, ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
    return w, ids.int()


e, n, k, topk = SHAPES["qwen3"]
w1 = (torch.randn(e, 2 * n, k, device="cuda") / k ** 0.5).bfloat16()
w2 = (torch.randn(e, k, n, device="cuda") / n ** 0.5).bfloat16()
for m in (1, 2, 3, 4, 8):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    t = {"default": [], "before": []}
    for trial in range(2):
        w, ids = routing(m, e, topk)
        fn = lambda: tmoe.fused_experts(x, w1, w2, w, ids)  # noqa: E731
        t["default"].append(bench(fn))
        with override_route("slots" if m == 1 else "sorted"):
            t["before"].append(bench(fn))
    print(f"qwen3 bf16 M={m} fused={tmoe.config.use_fused_route(m, n, k)} "
          + "  ".join(f"{c} {sum(v) / 2:.1f}" for c, v in t.items()), flush=True)
del w1, w2
for name, (e, n, k, topk) in {"gpt-oss-20b": (32, 2880, 2880, 4), "gpt-oss-120b": (128, 2880, 2880, 4)}.items():
    w1 = (torch.randn(e, 2 * n, k, device="cuda") / k ** 0.5).bfloat16()
    w2 = (torch.randn(e, k, n, device="cuda") / n ** 0.5).bfloat16()
    (q1, s1, _), (q2, s2, _) = quantize(w1, "mxfp4"), quantize(w2, "mxfp4")
    qc = tmoe.FusedMoEQuantConfig(weight_dtype="mxfp4", group_size=32)
    for m in (1, 8):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w, ids = routing(m, e, topk)
        h = get_config(m, e, n, k, topk, x.device, quant=qc.quant_name, group_size=32)
        mx = bench(lambda: tmoe.fused_experts(x, q1, q2, w, ids, quant_config=qc, w1_scale=s1, w2_scale=s2))
        bf = bench(lambda: tmoe.fused_experts(x, w1, w2, w, ids))
        print(f"{name} M={m} mxfp4 {h.up.block_m}x{h.up.block_n}x{h.up.block_k}/{h.down.block_n}x{h.down.block_k} "
              f"{mx:.1f} us, bf16 {bf:.1f} us", flush=True)
    del w1, w2, q1, q2
    torch.cuda.empty_cache()
