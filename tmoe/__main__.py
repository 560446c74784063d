"""``python -m tmoe``: a demo layer checked against the reference; ``python -m tmoe bench ...``
runs the benchmark; ``python -m tmoe tune ...`` tunes tile configs."""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:
        from tmoe.benchmark import main as bench_main

        return bench_main(argv[1:]) or 0
    if argv[:1] == ["tune"]:
        from tmoe.tune import main as tune_main

        return tune_main(argv[1:]) or 0
    from tmoe.demo import run_demo

    run_demo()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
