"""Is an AOTInductor package of a tmoe layer as fast as eager and torch.compile?

Qwen3-30B-A3B's layer (E=128, N=768, K=2048, topk=8, bf16, router included) exported with a
dynamic M, packaged, loaded back; median latency (``triton.testing.do_bench``) of the package,
eager and ``torch.compile(fullgraph=True)`` at M = 1, 64, 4096. Prints a table.

    python bench/repro_aoti_latency.py            # on a GPU
    python bench/repro_aoti_latency.py --tiny     # CPU smoke run: small shapes, perf_counter medians
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

import tmoe
from tmoe.testing import assert_close

FULL = dict(e=128, n=768, k=2048, topk=8, ms=(1, 64, 4096))
TINY = dict(e=4, n=32, k=64, topk=2, ms=(1, 3, 8))


def median_ms(fn: Callable[[], object], tiny: bool) -> float:
    if not tiny:
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(tiny: bool) -> list[tuple[int, float, float, float]]:
    """Rows (M, package ms, eager ms, compiled ms)."""
    shape = TINY if tiny else FULL
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    torch.manual_seed(0)
    layer = tmoe.FusedMoE(shape["e"], shape["k"], shape["n"], shape["topk"], dtype=dtype, device=device).eval()
    example = torch.randn(max(2, shape["ms"][1]), shape["k"], dtype=dtype, device=device)
    program = torch.export.export(layer, (example,),
                                  dynamic_shapes=({0: torch.export.Dim("m", min=1, max=max(shape["ms"]))},))
    with tempfile.TemporaryDirectory() as tmp:
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(Path(tmp) / "moe.pt2"))
        package = torch._inductor.aoti_load_package(path)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    rows = []
    with torch.no_grad():
        for m in shape["ms"]:
            x = torch.randn(m, shape["k"], dtype=dtype, device=device)
            eager = layer(x)
            assert_close(package(x), eager, dtype, name=f"package at M={m}")
            rows.append((m, median_ms(lambda: package(x), tiny), median_ms(lambda: layer(x), tiny),
                         median_ms(lambda: compiled(x), tiny)))
    name = "cpu (interpreter)" if tiny else torch.cuda.get_device_name()
    print(f"{name}, E={shape['e']} N={shape['n']} K={shape['k']} topk={shape['topk']} {str(dtype)[6:]}, "
          f"tmoe {tmoe.__file__}, torch {torch.__version__}")
    print(f"{'M':>6} {'AOTI package ms':>16} {'eager ms':>10} {'torch.compile ms':>17}")
    for m, pkg, eager_ms, comp in rows:
        print(f"{m:>6} {pkg:>16.4f} {eager_ms:>10.4f} {comp:>17.4f}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes on CPU (a smoke run)")
    main(parser.parse_args().tiny)
