"""One layer call per argv case (shape scheme M [route]), three times (the first compiles): for ncu."""
import sys
import torch
import tmoe
from tmoe.tools.low_bit import quantize

SHAPES = {"qwen3": (128, 768, 2048, 8), "mixtral": (8, 14336, 4096, 2), "deepseek": (256, 2048, 7168, 8)}
name, scheme, m = sys.argv[1], sys.argv[2], int(sys.argv[3])
e, n, k, topk = SHAPES[name]
dev = "cuda"
torch.manual_seed(0)
w1 = (torch.randn(e, 2 * n, k, device=dev) / k ** 0.5).bfloat16()
w2 = (torch.randn(e, k, n, device=dev) / n ** 0.5).bfloat16()
x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
w, ids = torch.topk(torch.randn(m, e, device=dev).softmax(-1), topk)
ids = ids.int()
if scheme == "bf16":
    fn = lambda: tmoe.fused_experts(x, w1, w2, w, ids)  # noqa
else:
    (q1, s1, z1), (q2, s2, z2) = quantize(w1, scheme), quantize(w2, scheme)
    del w1, w2
    qc = tmoe.FusedMoEQuantConfig(weight_dtype=scheme, group_size=32 if scheme == "mxfp4" else 128)
    fn = lambda: tmoe.fused_experts(x, q1, q2, w, ids, quant_config=qc, w1_scale=s1, w2_scale=s2,  # noqa
                                    w1_zp=z1, w2_zp=z2)
for _ in range(3):
    fn()
torch.cuda.synchronize()
