"""A: int4 group 32 with zero points (every K step spans 4 groups): PTX (scaled) vs int32 path,
whole layer, graph replay, table tiles. B: int4 group 128: block_k 256 tiles (the scaled PTX)
against the table rows, GEMMs alone."""
import time
import torch
import triton
import tmoe
from tmoe.config import GemmConfig as G
from tmoe.kernels import gemm_args
from tmoe.kernels.launch import clear_launch_caches
from tmoe.tools.tune import SHAPES, make_problem, _gemm_runs, _fastest

t0 = time.time()
real = gemm_args.asm_unpack
for name in ("qwen3", "mixtral", "deepseek"):
    e, n, k, topk = SHAPES[name]
    group = 32
    w1 = (torch.randn(e, 2 * n, k, device="cuda") / k ** 0.5).bfloat16()
    w2 = (torch.randn(e, k, n, device="cuda") / n ** 0.5).bfloat16()
    parts = [tmoe.quantize_weight_int4(c, group, zero_point=True) for c in w1.split(8)]
    q1, s1, z1 = (torch.cat(t) for t in zip(*parts))
    parts = [tmoe.quantize_weight_int4(c, group, zero_point=True) for c in w2.split(8)]
    q2, s2, z2 = (torch.cat(t) for t in zip(*parts))
    del w1, w2, parts
    qc = tmoe.FusedMoEQuantConfig(weight_dtype="int4", group_size=group)
    for m in (1, 8, 64, 256):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w, ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
        ids = ids.int()
        fn = lambda: tmoe.fused_experts(x, q1, q2, w, ids, quant_config=qc, w1_scale=s1, w2_scale=s2,  # noqa
                                        w1_zp=z1, w2_zp=z2)
        res, outs = [], []
        for asm in (False, True):
            gemm_args.asm_unpack = real if asm else (lambda *a: False)
            clear_launch_caches()
            outs.append(fn())
            res.append(triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3)
        same = torch.equal(outs[0], outs[1])
        print(f"A {name:8s} int4 g32 M={m:4d} int32 {res[0]:8.1f} us  ptx {res[1]:8.1f} us  x{res[0] / res[1]:.2f}  "
              f"bit-identical {same}", flush=True)
    del q1, q2, s1, s2, z1, z2
    torch.cuda.empty_cache()
gemm_args.asm_unpack = real
clear_launch_caches()
from tmoe.config import read_table, config_file_name, device_name
from tmoe.config.tables import SHIPPED_CONFIGS
for name, ms in (("mixtral", (8, 64, 256)), ("qwen3", (8, 64, 256)), ("deepseek", (8, 64, 256))):
    e, n, k, topk = SHAPES[name]
    p = make_problem(e, n, k, topk, torch.bfloat16, "int4")
    table = read_table(SHIPPED_CONFIGS / config_file_name(e, n, device_name(torch.device("cuda")), "int4_w4a16", None))
    for m in ms:
        row = table[m]
        bm = row.block_m
        up, down = _gemm_runs(m, p, bm)
        if bm >= 64:
            extra = [G(bm, 64, 256, 8, 8, 3), G(bm, 64, 256, 8, 8, 3, swap_ab=True), G(bm, 64, 256, 8, 4, 3),
                     G(bm, 128, 128, 8, 8, 3, swap_ab=True), G(bm, 64, 256, 8, 8, 2, swap_ab=True)]
        else:
            extra = [G(bm, 64, 256, 8, 4, 3), G(bm, 128, 256, 8, 4, 3), G(bm, 32, 256, 8, 4, 3), G(bm, 64, 256, 8, 4, 4)]
        for gname, own, run in (("up", row.up, up), ("down", row.down, down)):
            line = []
            for cfg in [own] + extra:
                us, _ = _fastest([cfg], run)
                line.append((us, cfg))
            txt = "  ".join(f"{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}{'S' if c.swap_ab else ''}:{u:.1f}"
                            for u, c in line)
            best = min(line, key=lambda r: r[0])
            print(f"B {name:8s} int4 M={m:4d} {gname:4s} table {line[0][0]:8.1f} best x{line[0][0] / best[0]:.2f} | {txt}",
                  flush=True)
    del p
    torch.cuda.empty_cache()
print(f"done {time.time() - t0:.0f} s")
