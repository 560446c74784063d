"""How large should the align stage's chunks be, and how wide its scan? Times
``moe_align_block_size`` (count, scan and scatter launches; CUDA-graph replay,
``triton.testing.do_bench_cudagraph`` median) under candidate constants of ``tmoe.kernels.align``
at the Qwen3-30B-A3B, DeepSeek-V3 and Mixtral-8x7B routing sizes, checks every candidate's
outputs equal the first's, and prints µs per case and candidate. GPU only:
``python bench/repro_align_chunks.py [--out CSV]`` (``--out`` appends one row per case and
candidate: FIELDS)."""
from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import NamedTuple

import torch
import triton

from tmoe.kernels import align
from tmoe.runtime.state import clear_launch_caches
from tmoe.tools.results import append_lines, git_commit

# (name, M, E, topk, block_m): the block size each shape's layer aligns to at that M
CASES = [("qwen3", 1024, 128, 8, 64), ("qwen3", 4096, 128, 8, 64), ("qwen3", 16384, 128, 8, 64),
         ("deepseek", 1024, 256, 8, 64), ("deepseek", 4096, 256, 8, 128),
         ("mixtral", 4096, 8, 2, 128), ("mixtral", 16384, 8, 2, 128)]


class Candidate(NamedTuple):
    subs_per_chunk: int
    target_chunks: int  # 1 << 40: chunks never grow past subs_per_chunk sub-tiles
    scan_tile_elements: int
    scan_warps: int


CANDIDATES = [Candidate(4, 1 << 40, 8192, 16), Candidate(4, 1 << 40, 4096, 4),
              Candidate(align.SUBS_PER_CHUNK, align.TARGET_CHUNKS, align.SCAN_TILE_ELEMENTS, align.SCAN_WARPS),
              Candidate(4, 64, 4096, 4), Candidate(4, 256, 4096, 4), Candidate(4, 128, 8192, 16)]
FIELDS = ["date", "gpu", "torch", "triton", "commit", "shape", "M", "E", "topk", "block_m", "candidate", "us"]


def _set(c: Candidate) -> None:
    align.SUBS_PER_CHUNK, align.TARGET_CHUNKS, align.SCAN_TILE_ELEMENTS, align.SCAN_WARPS = c
    clear_launch_caches()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="CSV to append rows to")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("repro_align_chunks needs a CUDA device")
    shipped = Candidate(align.SUBS_PER_CHUNK, align.TARGET_CHUNKS, align.SCAN_TILE_ELEMENTS, align.SCAN_WARPS)
    env = [datetime.datetime.now().isoformat(timespec="seconds"), torch.cuda.get_device_name(), torch.__version__,
           triton.__version__, git_commit()]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print("case | " + " | ".join(str(tuple(c)) for c in CANDIDATES) + "  (µs; shipped: %s)" % (tuple(shipped),))
    try:
        for shape, m, e, topk, block_m in CASES:
            ids = torch.argsort(torch.rand(m, e, device="cuda", generator=g), dim=1)[:, :topk].int().contiguous()
            first, line = None, []
            for c in CANDIDATES:
                _set(c)
                out = [t.clone() for t in align.moe_align_block_size(ids, block_m, e)]
                if first is None:
                    first = out
                if not all(torch.equal(a, b) for a, b in zip(out, first)):
                    raise AssertionError(f"{shape} M={m}: candidate {c} gives other outputs than {CANDIDATES[0]}")
                us = 1e3 * triton.testing.do_bench_cudagraph(lambda: align.moe_align_block_size(ids, block_m, e), rep=50)
                line.append(f"{us:.1f}")
                rows.append([*env, shape, m, e, topk, block_m, repr(c), f"{us:.1f}"])
            print(f"{shape} M={m} | " + " | ".join(line), flush=True)
    finally:
        _set(shipped)
    if args.out is not None:
        append_lines(args.out, FIELDS, rows)


if __name__ == "__main__":
    main()
