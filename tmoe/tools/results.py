"""The benchmark's result rows and where they go: the Markdown table, the CSV file (one line per
row, appended as measured) and the roofline plot."""
from __future__ import annotations

import csv
import itertools
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tmoe.tools.inputs import Shape

Measurement = float | str  # microseconds, or why there is none


@dataclass(frozen=True)
class Row:
    """One measurement; times in µs; ``nbytes``/``flops`` of one call, ``touched`` averaged over sets."""

    shape: Shape
    dtype: str
    m: int
    provider: str
    graph: Measurement
    eager: Measurement
    floor: float
    nbytes: float
    flops: float
    touched: float

    @property
    def best_us(self) -> float | None:
        for t in (self.graph, self.eager):
            if isinstance(t, float):
                return t
        return None

    def per_second(self, amount: float) -> float | None:
        return None if self.best_us is None else amount / (self.best_us * 1e-6)


def _cell(v: Measurement | None, fmt: str = "{:.1f}") -> str:
    if v is None:
        return "n/a"
    return fmt.format(v) if isinstance(v, float) else f"n/a ({v})"


def row_cells(r: Row) -> list[str]:
    """Table cells: shape, M, provider, graph µs, eager µs, floor µs, fraction, TB/s, TFLOP/s."""
    frac = None if r.best_us is None else r.floor / r.best_us
    tbs, tflops = r.per_second(r.nbytes), r.per_second(r.flops)
    return [r.shape.name, str(r.m), r.provider, _cell(r.graph), _cell(r.eager), _cell(r.floor),
            _cell(frac, "{:.2f}"), _cell(None if tbs is None else tbs / 1e12, "{:.2f}"),
            _cell(None if tflops is None else tflops / 1e12, "{:.1f}")]


TABLE_HEADER = ["shape", "M", "provider", "graph µs", "eager µs", "floor µs", "fraction of floor", "TB/s", "TFLOP/s"]


def markdown_table(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    return "\n".join(lines + ["| " + " | ".join(row_cells(r)) + " |" for r in rows]) + "\n"


@dataclass(frozen=True)
class Env:
    date: str
    gpu: str
    torch: str
    triton: str
    commit: str


def git_commit() -> str:
    """``git rev-parse --short HEAD`` in the working directory, "unknown" when that fails."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


CSV_FIELDS = ["date", "gpu", "torch", "triton", "commit", "shape", "E", "N", "K", "topk", "dtype", "M", "provider",
              "graph_us", "eager_us", "floor_us", "fraction", "tb_s", "tflop_s", "touched_experts"]


def append_lines(path: Path, fields: Sequence[str], lines: Sequence[Sequence]) -> None:
    """Append ``lines`` to the CSV at ``path``, writing the header ``fields`` when the file is new."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(fields)
        w.writerows(lines)


def append_csv(path: Path, rows: Sequence[Row], env: Env) -> None:
    """Append one line per row, writing the header when the file is new."""
    append_lines(path, CSV_FIELDS, [
        [env.date, env.gpu, env.torch, env.triton, env.commit, r.shape.name, r.shape.e, r.shape.n, r.shape.k,
         r.shape.topk, r.dtype, r.m, r.provider, *row_cells(r)[3:], f"{r.touched:g}"] for r in rows])


def write_plot(path: Path, rows: Sequence[Row]) -> bool:
    """Fraction of floor vs M (log x), one line per shape x provider; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no plot", flush=True)
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    shapes = sorted({r.shape.name for r in rows})
    styles = {"tmoe": "-", "grouped_mm": "--", "scaled_grouped_mm": (0, (5, 1, 1, 1, 1, 1)), "loop": ":"}
    for (shape, prov), grp in itertools.groupby(sorted(rows, key=lambda r: (r.shape.name, r.provider, r.m)),
                                                key=lambda r: (r.shape.name, r.provider)):
        pts = [(r.m, r.floor / r.best_us) for r in grp if r.best_us]
        if pts:
            ax.plot(*zip(*pts), marker="o", linestyle=styles.get(prov, "-."), color=f"C{shapes.index(shape)}",
                    label=f"{shape} {prov}")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set(xscale="log", xlabel="M (tokens)", ylabel="fraction of roofline floor", ylim=(0, None))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True
