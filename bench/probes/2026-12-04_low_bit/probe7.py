"""GPT-OSS shapes (no shipped table: the heuristic's tiles) with mxfp4 weights (group 32): the
heuristic (block_k capped at the group) against the same tiles with block_k 64/128/256 (K steps
over several groups: the scaled PTX on sm_90), whole layer, graph replay; and beside bf16."""
from dataclasses import replace
import torch
import triton
import tmoe
from tmoe.config import MoEConfig, override_config, get_config
from tmoe.tools.low_bit import quantize

for name, (e, n, k, topk) in {"gpt-oss-20b": (32, 2880, 2880, 4), "gpt-oss-120b": (128, 2880, 2880, 4)}.items():
    w1 = (torch.randn(e, 2 * n, k, device="cuda") / k ** 0.5).bfloat16()
    w2 = (torch.randn(e, k, n, device="cuda") / n ** 0.5).bfloat16()
    (q1, s1, _), (q2, s2, _) = quantize(w1, "mxfp4"), quantize(w2, "mxfp4")
    qc = tmoe.FusedMoEQuantConfig(weight_dtype="mxfp4", group_size=32)
    for m in (1, 8, 64, 256, 1024):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w, ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
        ids = ids.int()
        heur = get_config(m, e, n, k, topk, x.device, quant=qc.quant_name, group_size=32)
        line = []
        bf = triton.testing.do_bench_cudagraph(lambda: tmoe.fused_experts(x, w1, w2, w, ids), rep=30) * 1e3
        for bk in (heur.up.block_k, 64, 128, 256):
            cfg = MoEConfig(replace(heur.up, block_k=bk), replace(heur.down, block_k=bk))
            with override_config(cfg):
                fn = lambda: tmoe.fused_experts(x, q1, q2, w, ids, quant_config=qc, w1_scale=s1, w2_scale=s2)  # noqa
                fn()
                line.append((bk, triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3))
        print(f"{name} M={m:5d} heuristic {heur.up.block_m}x{heur.up.block_n}x{heur.up.block_k}w{heur.up.num_warps}"
              f"s{heur.up.num_stages} | " + "  ".join(f"bk{bk} {us:.1f}" for bk, us in line) + f" | bf16 {bf:.1f} us",
              flush=True)
    del w1, w2, q1, q2
    torch.cuda.empty_cache()
