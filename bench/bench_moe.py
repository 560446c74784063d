"""Whole-layer MoE benchmark: tmoe vs torch._grouped_mm vs a per-expert loop, beside the roofline.

    python bench/bench_moe.py [--shapes mixtral,qwen3,deepseek] [--ms 1,8,64,...]
        [--dtype bf16|fp8_block|fp8_token|int4|int8|mxfp4] [--quick] [--stages]
        [--csv bench/results/bench_moe.csv --out bench/results]  (without them nothing is written)

Needs a CUDA GPU; ``--help`` lists every option. The harness is ``tmoe.tools.bench`` (``python -m tmoe bench``).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tmoe.tools.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
