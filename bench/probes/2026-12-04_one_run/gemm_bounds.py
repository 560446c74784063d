"""Where the large-M GEMM time goes: each tmoe expert GEMM (up with silu, down) at the bench's
random routing, against the same kernel and tiles on (1) balanced routing (every expert exactly
M*topk/E slots, a multiple of block_m: no padding, tokens in runs of M/(E/topk)), (2) one expert
(E=1: a dense GEMM with gathered A rows, the tile loop without MoE), and against cuBLAS: (3) one
dense torch.mm of the same FLOPs and (4) torch._grouped_mm on the random routing's exact groups.
TFLOP/s count the real rows' FLOPs; the padding factor is the aligned rows over the real ones.

    python bench/probes/2026-12-04_one_run/gemm_bounds.py  (prints a table; H200, do_bench medians)
"""
import torch
import triton.testing

import tmoe
from tmoe.tools import peers

CASES = [("mixtral", 8, 14336, 4096, 2, (1024, 4096, 16384)), ("qwen3", 128, 768, 2048, 8, (1024, 4096, 16384)),
         ("deepseek", 256, 2048, 7168, 8, (1024, 4096))]
ops = torch.ops.tmoe


def us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def balanced_ids(m: int, e: int, topk: int) -> torch.Tensor:
    """Slot (t, j) -> expert (t // run + j * E/topk) % E with run = M / (E/topk): exactly M*topk/E slots each."""
    t = torch.arange(m, device="cuda")[:, None]
    j = torch.arange(topk, device="cuda")[None, :]
    return ((t * (e // topk) // m + j * (e // topk)) % e).to(torch.int32)


def gemm_times(x, w1, w2, ids, topk, cfg) -> tuple[float, float, float]:
    """(up µs, down µs, padding factor) of tmoe's two GEMMs under ``cfg``."""
    bm = cfg.block_m
    with tmoe.override_config(cfg):
        route = ops.moe_align_block_size(ids, bm, w1.shape[0])
        inter = ops.moe_gemm_up(x, w1, *route, topk, bm)
        t_up = us(lambda: ops.moe_gemm_up(x, w1, *route, topk, bm))
        t_down = us(lambda: ops.moe_gemm_down(inter, w2, *route, topk, bm))
    return t_up, t_down, int(route[2].item()) / ids.numel()


def main() -> None:
    print("| shape | M | GEMM | tiles | random (pad) | balanced | E=1 dense | cuBLAS mm | cuBLAS grouped |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, e, n, k, topk, ms in CASES:
        w1, w2 = peers.make_weights(e, n, k, torch.device("cuda"))
        for m in ms:
            slots = m * topk
            cfg = tmoe.get_config(m, e, n, k, topk, w1.device)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk).indices.to(torch.int32)
            rnd = gemm_times(x, w1, w2, ids, topk, cfg)
            bal = gemm_times(x, w1, w2, balanced_ids(m, e, topk), topk, cfg)
            one = gemm_times(x, w1[:1], w2[:1], torch.zeros_like(ids), topk, cfg)
            a_up = torch.randn(slots, k, device="cuda", dtype=torch.bfloat16)
            a_down = torch.randn(slots, n, device="cuda", dtype=torch.bfloat16)
            mm_up, mm_down = us(lambda: a_up @ w1[0].T), us(lambda: a_down @ w2[0].T)
            order, token, offs = peers._sort_by_expert(ids, e)
            w1_t, w2_t = w1.transpose(1, 2), w2.transpose(1, 2)
            g_up = us(lambda: torch._grouped_mm(a_up, w1_t, offs=offs))
            g_down = us(lambda: torch._grouped_mm(a_down, w2_t, offs=offs))
            for gemm, i, flops, t_mm, t_g, tiles in (
                    ("up", 0, 4.0 * slots * n * k, mm_up, g_up, cfg.up), ("down", 1, 2.0 * slots * n * k, mm_down,
                                                                          g_down, cfg.down)):
                rate = lambda t: f"{t:.0f} µs {flops / t / 1e6:.0f}"  # noqa: E731  (µs, TFLOP/s)
                desc = f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k} w{tiles.num_warps} s{tiles.num_stages}" + \
                    (" tma" if tiles.tma else "") + (" pers" if tiles.persistent else "")
                print(f"| {name} | {m} | {gemm} | {desc} | {rate(rnd[i])} ({rnd[2]:.2f}x) | {rate(bal[i])} | "
                      f"{rate(one[i])} | {rate(t_mm)} | {rate(t_g)} |", flush=True)
            del a_up, a_down
        del w1, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
