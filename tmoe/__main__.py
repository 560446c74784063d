"""``python -m tmoe [demo|bench|bench-ep|bench-hf|bench-train|tune|tables] ...``: the command-line tools in ``tmoe.tools``."""
from __future__ import annotations

import sys

USAGE = """usage: python -m tmoe [demo | bench ... | bench-ep ... | bench-hf ... | bench-train ... | tune ... | tables ... | -h]

  demo    (default) a random MoE layer run eager, compiled and (GPU) as a CUDA graph, each
          checked against the float32 reference, with error and time
  bench   the whole-layer benchmark against the roofline and peers (GPU); bench -h for options
  bench-ep  expert parallelism: all-gather vs all-to-all step, dispatch and combine times and
          bytes per rank (spawns --world-size processes, NCCL); bench-ep -h for options
  bench-hf  transformers' experts implementations (tmoe, grouped_mm, eager): a decoder layer's
          training step and compiled generate (GPU; --tiny on CPU); bench-hf -h for options
  tune    tile-config tuning into vLLM-named JSON tables (GPU); tune -h for options
  bench-train  forward+backward time and peak memory against the floor, grouped_mm and Liger (GPU;
          --tiny on CPU); bench-train -h for options
  tables  the benchmark tables from one run's bench_moe.csv or bench_train.csv rows; tables -h for options
"""

DEMO_USAGE = """usage: python -m tmoe demo

  a random MoE layer run eager, compiled and (GPU) as a CUDA graph, each checked against the
  float32 reference, with error and time (no options)"""


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("demo", [])
    if command in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if command == "bench":
        from tmoe.tools.bench import main as bench_main

        return bench_main(rest) or 0
    if command == "bench-ep":
        from tmoe.tools.bench_ep import main as bench_ep_main

        return bench_ep_main(rest) or 0
    if command == "bench-hf":
        from tmoe.tools.bench_hf import main as bench_hf_main

        return bench_hf_main(rest) or 0
    if command == "bench-train":
        from tmoe.tools.bench_train import main as bench_train_main

        return bench_train_main(rest) or 0
    if command == "tune":
        import torch

        if not torch.cuda.is_available() and not {"-h", "--help"} & set(rest):
            print("tune times compiled kernels on a GPU: it needs a CUDA device (none found); on CPU the "
                  "heuristic configs and the shipped tables are used", file=sys.stderr)
            return 2
        from tmoe.tools.tune import main as tune_main

        return tune_main(rest) or 0
    if command == "tables":
        from tmoe.tools.tables import main as tables_main

        return tables_main(rest)
    if command == "demo" and {"-h", "--help"} & set(rest):
        print(DEMO_USAGE)
        return 0
    if command == "demo" and not rest:
        from tmoe.tools.demo import run_demo

        run_demo()
        return 0
    print(f"unknown command {' '.join(argv)!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
