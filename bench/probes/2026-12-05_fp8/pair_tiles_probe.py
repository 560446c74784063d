"""bf16 large-M rows against the tiles that fit twice in an SM (tune.LARGE_TILES' last three: three
32 KB stages at block_m 128, so one program's loads can overlap the other's MMAs). For each shipped
row at M = 1024, 4096, 16384: each GEMM's table tile and the pair tiles (pointer and TMA weights) at
the row's block_m, do_bench medians of the GEMM alone (tune's runs). Writes the rows that keep the
faster tile per GEMM into ``argv[1]`` (a TMOE_CONFIG_DIR).

    python bench/probes/2026-12-05_fp8/pair_tiles_probe.py OUT_DIR
"""
import sys
from dataclasses import replace
from pathlib import Path

import torch

from tmoe.config import config_file_name, device_name, read_table, save_table
from tmoe.config.tables import SHIPPED_CONFIGS
from tmoe.tools.tune import LARGE_TILES, SHAPES, _fastest, _gemm_runs, make_problem

PAIR_TILES = LARGE_TILES[-3:]
MS = (1024, 4096, 16384)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for shape, (e, n, k, topk) in SHAPES.items():
        name = config_file_name(e, n, device_name(torch.device("cuda")), None)
        table = read_table(SHIPPED_CONFIGS / name)
        p = make_problem(e, n, k, topk, torch.bfloat16, "none")
        for m in MS if shape != "deepseek" else MS[:2]:
            row = table[m]
            up, down = _gemm_runs(m, p, row.up.block_m)
            picked = []
            for what, own, run in (("up", row.up, up), ("down", row.down, down)):
                t_own, _ = _fastest([own], run)
                pairs = [replace(own, block_n=bn, block_k=bk, num_warps=w, num_stages=s, tma=t, persistent=False,
                                 swap_ab=False) for bn, bk, w, s in PAIR_TILES for t in (False, True)]
                t_new, best = _fastest(pairs, run)
                print(f"{shape} M={m} {what}: table {t_own:.1f} us {own}; best pair tile {t_new:.1f} us {best} "
                      f"({t_own / t_new:.3f}x)", flush=True)
                picked.append(best if t_new < t_own else own)
            table[m] = replace(row, up=picked[0], down=picked[1])
            save_table(out / name, table)
        del p
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
