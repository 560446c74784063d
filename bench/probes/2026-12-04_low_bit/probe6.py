"""Mixtral M=256 low-bit: block_m 128 tiles (one row block per expert mostly, weights dequantized
once) against the table's block_m 64 rows, GEMMs alone (sorted route), same routing per scheme."""
import torch
from tmoe.config import GemmConfig as G
from tmoe.tools.tune import SHAPES, make_problem, _gemm_runs, _fastest

e, n, k, topk = SHAPES["mixtral"]
sets = {"int4": ([G(64, 64, 256, 8, 4, 3)], [G(64, 64, 256, 8, 4, 3)],
                 [G(128, 32, 256, 8, 8, 3), G(128, 32, 256, 8, 8, 4)], [G(128, 64, 256, 8, 8, 3), G(128, 32, 256, 8, 8, 3)]),
        "mxfp4": ([G(64, 64, 128, 8, 4, 3)], [G(64, 64, 128, 8, 4, 3)],
                  [G(128, 64, 256, 8, 8, 3), G(128, 64, 128, 8, 8, 3), G(128, 32, 256, 8, 8, 3)],
                  [G(128, 64, 128, 8, 8, 3), G(128, 64, 256, 8, 8, 3)])}
for scheme, (up64, down64, up128, down128) in sets.items():
    p = make_problem(e, n, k, topk, torch.bfloat16, scheme)
    torch.manual_seed(5)
    for bm, ups, downs in ((64, up64, down64), (128, up128, down128)):
        torch.manual_seed(5)  # the same routing for both block sizes
        up, down = _gemm_runs(256, p, bm)
        tu = [(_fastest([c], up)[0], c) for c in ups]
        td = [(_fastest([c], down)[0], c) for c in downs]
        for t, c in tu + td:
            print(f"  {scheme} bm{bm} {c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}: {t:.1f}", flush=True)
        print(f"{scheme} block_m {bm}: best up {min(tu, key=lambda r: r[0])[0]:.1f} + down {min(td, key=lambda r: r[0])[0]:.1f}"
              f" = {min(tu, key=lambda r: r[0])[0] + min(td, key=lambda r: r[0])[0]:.1f} us", flush=True)
    del p
    torch.cuda.empty_cache()
