"""Plot fraction of the roofline floor vs M from bench/results/bench_moe.csv (one line per
shape x provider, one figure per dtype): ``python bench/plot_results.py [csv] [out_dir] [commit]``.
With a commit, only that run's rows (and its GPU in the title); without, the newest row per cell."""
from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(csv_path: Path, out_dir: Path, commit: str | None = None) -> None:
    latest: dict[tuple[str, str, str, int], float] = {}  # later rows (newer runs) win
    gpus: set[str] = set()
    for row in csv.DictReader(csv_path.open()):
        if commit is not None and row["commit"] != commit:
            continue
        gpus.add(row["gpu"])
        try:
            latest[(row["dtype"], row["shape"], row["provider"], int(row["M"]))] = float(row["fraction"])
        except ValueError:
            continue
    if not latest:
        sys.exit(f"no rows{f' of commit {commit}' if commit else ''} in {csv_path}")
    run = f"{', '.join(sorted(gpus))}, {commit}" if commit else "newest row per cell"
    series: dict[str, dict[tuple[str, str], list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for (dtype, shape, provider, m), fraction in latest.items():
        series[dtype][(shape, provider)].append((m, fraction))
    styles = {"tmoe": "-", "grouped_mm": "--", "loop": ":"}
    for dtype, lines in series.items():
        shapes = sorted({shape for shape, _ in lines})
        fig, ax = plt.subplots(figsize=(8, 5))
        for (shape, provider), pts in sorted(lines.items()):
            pts.sort()
            ax.plot(*zip(*pts), marker="o", linestyle=styles.get(provider, "-."), color=f"C{shapes.index(shape)}",
                    label=f"{shape} {provider}")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set(xscale="log", xlabel="M (tokens)", ylabel="fraction of roofline floor", ylim=(0, 1.15),
               title=f"MoE layer, {dtype}, CUDA-graph replay (loop peer: eager); {run}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        name = "roofline.png" if dtype == "bf16" else f"roofline_{dtype}.png"
        fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        print(f"wrote {out_dir / name}")


if __name__ == "__main__":
    results = Path(__file__).parent / "results"
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else results / "bench_moe.csv",
         Path(sys.argv[2]) if len(sys.argv) > 2 else results, sys.argv[3] if len(sys.argv) > 3 else None)
