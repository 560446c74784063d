"""int4 (group 128, zero points) M=1 whole layer (slots route), graph replay: the table's M=1 row
against block_k 256 up/down tiles (the scaled PTX), three routings each."""
import torch
import triton
import tmoe
from tmoe.config import GemmConfig as G, MoEConfig, override_config, read_table, config_file_name
from tmoe.config.tables import SHIPPED_CONFIGS
from tmoe.tools.low_bit import quantize
from tmoe.tools.tune import SHAPES

for name in ("qwen3", "mixtral", "deepseek"):
    e, n, k, topk = SHAPES[name]
    w1 = (torch.randn(e, 2 * n, k, device="cuda") / k ** 0.5).bfloat16()
    w2 = (torch.randn(e, k, n, device="cuda") / n ** 0.5).bfloat16()
    (q1, s1, z1), (q2, s2, z2) = quantize(w1, "int4"), quantize(w2, "int4")
    del w1, w2
    qc = tmoe.FusedMoEQuantConfig(weight_dtype="int4", group_size=128)
    row = read_table(SHIPPED_CONFIGS / config_file_name(e, n, "NVIDIA_H200", "int4_w4a16", None))[1]
    up2, down2 = G(16, 64, 256, 8, 4, 3), G(16, 128, 256, 8, 4, 3)
    cands = {"table": row, "up256": MoEConfig(up2, row.down), "down256": MoEConfig(row.up, down2),
             "both256": MoEConfig(up2, down2), "up32x256": MoEConfig(G(16, 32, 256, 8, 4, 3), down2)}
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    times = {c: [] for c in cands}
    for trial in range(3):
        w, ids = torch.topk(torch.randn(1, e, device="cuda").softmax(-1), topk)
        ids = ids.int()
        for c, cfg in cands.items():
            with override_config(cfg):
                fn = lambda: tmoe.fused_experts(x, q1, q2, w, ids, quant_config=qc, w1_scale=s1, w2_scale=s2,  # noqa
                                                w1_zp=z1, w2_zp=z2)
                fn()
                times[c].append(triton.testing.do_bench_cudagraph(fn, rep=40) * 1e3)
    print(name, "M=1 " + "  ".join(f"{c} {sum(t) / len(t):.1f}" for c, t in times.items()), flush=True)
    del q1, q2
    torch.cuda.empty_cache()
