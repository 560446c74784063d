"""Per cell (shape, scheme, M): the table's up/down configs against a few variants (stages,
warps, half block_k, half block_n), each GEMM timed alone as the tuner does (sorted route)."""
import sys
import time
from dataclasses import replace

import torch

from tmoe.config import read_table, config_file_name, device_name
from tmoe.config.tables import SHIPPED_CONFIGS
from tmoe.tools.tune import SHAPES, TABLE_DTYPES, make_problem, _gemm_runs, _fastest

t0 = time.time()
cells = [c.split(":") for c in sys.argv[1].split(",")]
problems = {}
for shape, scheme, m in cells:
    m = int(m)
    e, n, k, topk = SHAPES[shape]
    key = (shape, scheme)
    if key not in problems:
        problems.clear()
        torch.cuda.empty_cache()
        problems[key] = make_problem(e, n, k, topk, torch.bfloat16, scheme)
    p = problems[key]
    path = SHIPPED_CONFIGS / config_file_name(e, n, device_name(torch.device("cuda")), TABLE_DTYPES[scheme], None)
    table = read_table(path)
    row = table[min(table, key=lambda r: abs(r - m))]
    up, down = _gemm_runs(m, p, row.block_m)
    for name, own, run in (("up", row.up, up), ("down", row.down, down)):
        s, w = own.num_stages, own.num_warps
        variants = [own, replace(own, num_stages=s + 2), replace(own, num_warps=8), replace(own, num_warps=8, num_stages=s + 2),
                    replace(own, block_k=own.block_k // 2, num_stages=s + 2), replace(own, block_n=max(16, own.block_n // 2), num_stages=s + 1)]
        if own.swap_ab:
            variants.append(replace(own, swap_ab=False, num_warps=8))
        res = []
        for v in variants:
            try:
                us, _ = _fastest([v], run)
            except Exception as err:  # noqa
                us = float("nan")
            res.append((us, v))
        base = res[0][0]
        line = "  ".join(f"{v.block_m}x{v.block_n}x{v.block_k}w{v.num_warps}s{v.num_stages}{'S' if v.swap_ab else ''}:{us:.1f}"
                         for us, v in res)
        best = min(res, key=lambda r: r[0])
        print(f"{shape:8s} {scheme:5s} M={m:<4d} {name:4s} base {base:8.1f}  best x{base / best[0]:.2f}  | {line}", flush=True)
print(f"done {time.time() - t0:.0f} s")
