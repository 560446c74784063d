"""The align stage past one chunk: the three launches (count, scan, scatter) against the one sorting
program (``tmoe.kernels.align.SORT_MAX_SLOTS``), alone and inside the whole bf16 layer, CUDA-graph
replay medians over four rotated routings. Decides SORT_MAX_SLOTS.

    python bench/probes/2026-12-04_one_run/align_probe.py
"""
import torch

import tmoe
from tmoe.kernels import align
from tmoe.kernels.launch import clear_launch_caches
from tmoe.tools import peers, timing

SHAPES = {"mixtral": (8, 14336, 4096, 2), "qwen3": (128, 768, 2048, 8), "deepseek": (256, 2048, 7168, 8)}
ALIGN_MS = {"mixtral": (512, 1024, 2048), "qwen3": (32, 64, 128, 256, 512), "deepseek": (32, 64, 128, 256, 512)}
LAYER_MS = {"qwen3": (64, 256), "deepseek": (64, 256), "mixtral": (1024,)}


def timed(fn_sets, sort_max: int) -> float:
    align.SORT_MAX_SLOTS = sort_max
    clear_launch_caches()
    return timing.time_graph(fn_sets, min_rounds=50)


def main() -> None:
    print("| shape | M | slots | what | three launches µs | sorting program µs |")
    print("|---|---|---|---|---|---|")
    for name, (e, n, k, topk) in SHAPES.items():
        for m in ALIGN_MS[name]:
            sets = peers.make_inputs(m, e, k, topk, 4, torch.device("cuda"))
            block = tmoe.get_config(m, e, n, k, topk, torch.device("cuda")).block_m
            calls = [lambda r=r: tmoe.moe_align_block_size(r.topk_ids, block, e)[0] for r in sets]
            chunks, sort = timed(calls, 0), timed(calls, align.SORT_SLOT_LIMIT)
            print(f"| {name} | {m} | {m * topk} | align | {chunks:.1f} | {sort:.1f} |", flush=True)
        if name in LAYER_MS:
            w1, w2 = peers.make_weights(e, n, k, torch.device("cuda"))
            for m in LAYER_MS[name]:
                sets = peers.make_inputs(m, e, k, topk, 4, torch.device("cuda"))
                calls = [lambda r=r: tmoe.fused_experts(r.x, w1, w2, r.topk_weights, r.topk_ids) for r in sets]
                chunks, sort = timed(calls, 0), timed(calls, align.SORT_SLOT_LIMIT)
                print(f"| {name} | {m} | {m * topk} | layer | {chunks:.1f} | {sort:.1f} |", flush=True)
            del w1, w2
            torch.cuda.empty_cache()
    align.SORT_MAX_SLOTS = 0


if __name__ == "__main__":
    main()
