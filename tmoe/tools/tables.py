"""``python -m tmoe tables <bench_moe.csv> --commit C[,C2...] [--dtype D]``: the benchmark tables (bench/results/summary.md, the README)
(shapes x M) from one benchmark run's CSV rows: fraction of the floor (tmoe / peer), times (tmoe
graph / tmoe eager / peer eager) and, where the run timed them, the stages (graph µs and fraction of
each stage's own floor); then the cells below the layer's goals (``GOALS``), each with its stages.
Given ``bench_train.csv`` (``python -m tmoe bench-train``): forward+backward ms and peak MiB of
tmoe and its peers, and tmoe's fraction of the floor."""
from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Sequence

from tmoe.tools.stage_calls import STAGE_ORDER  # every stage, in the layer's order

PEERS = {"bf16": "grouped_mm", "fp8_block": "scaled_grouped_mm", "fp8_token": "scaled_grouped_mm"}
SHAPE_ORDER = ("mixtral", "qwen3", "deepseek")
# the whole layer's fraction-of-floor goals: (largest M, goal) in order of M
_FP8_GOALS = ((1, 0.85), (256, 0.95), (1 << 62, 0.65))
GOALS = {"bf16": ((1, 0.85), (256, 0.95), (1 << 62, 0.80)), "fp8_block": _FP8_GOALS, "fp8_token": _FP8_GOALS}


def load_rows(path: Path, commit: str, dtype: str) -> dict[tuple[str, int, str], dict[str, str]]:
    """The CSV rows of ``commit`` (a comma list: one run's commits, e.g. a rerun of some shapes
    after a change to the harness) and ``dtype``, keyed by (shape, M, provider); a later row of
    the same key (a rerun) replaces an earlier one."""
    commits = set(commit.split(","))
    with path.open(newline="") as f:
        return {(r["shape"], int(r["M"]), r["provider"]): r for r in csv.DictReader(f)
                if r["commit"] in commits and r["dtype"] == dtype}


def _shapes_and_ms(rows: dict) -> tuple[list[str], list[int]]:
    """The run's shapes (Mixtral, Qwen3, DeepSeek-V3 first) and token counts, in order."""
    shapes = sorted({s for s, _, _ in rows}, key=lambda s: (SHAPE_ORDER + (s,)).index(s))
    return shapes, sorted({m for _, m, _ in rows})


def _grid(labels: Sequence, ms: Sequence[int], cell) -> str:
    """A Markdown table of ``cell(label, m)`` with one row per label ("—" where it gives nothing)."""
    lines = ["| | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---|" * len(ms)]
    for label in labels:
        name = label if isinstance(label, str) else " ".join(label)
        lines.append(f"| {name} | " + " | ".join(cell(label, m) or "—" for m in ms) + " |")
    return "\n".join(lines) + "\n"


def _num(row: dict | None, field: str) -> str | None:
    """The field's value (fractions to 2 decimals, µs to 1 below 100, else whole), or None where
    the row is absent or has no number."""
    if row is None or row[field].startswith("n/a"):
        return None
    v = float(row[field])
    return f"{v:.2f}" if field == "fraction" else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def tables(rows: dict, dtype: str) -> str:
    """The fraction, time and stage tables of one run (Markdown)."""
    peer = PEERS.get(dtype, "tmoe_bf16")
    get = lambda s, m, p: rows.get((s, m, p))  # noqa: E731

    def fraction(s, m):
        own, other = _num(get(s, m, "tmoe"), "fraction"), _num(get(s, m, peer), "fraction")
        return own and f"{own} / {other or 'n/a'}"

    def times(s, m):
        own = get(s, m, "tmoe")
        return own and " / ".join(_num(r, f) or "n/a" for r, f in
                                  ((own, "graph_us"), (own, "eager_us"), (get(s, m, peer), "eager_us")))

    shapes, ms = _shapes_and_ms(rows)
    out = [f"fraction of the floor, tmoe / {peer}:\n\n", _grid(shapes, ms, fraction),
           f"\nµs, tmoe graph / tmoe eager / {peer} eager:\n\n", _grid(shapes, ms, times)]
    timed = sorted({p for _, _, p in rows if p.split(".")[0] in ("tmoe", peer) and "." in p}, key=_stage_key)
    stages = [p.split(".", 1)[1] for p in timed if p.startswith("tmoe.")]
    if timed:
        out += [f"\nstages alone, graph µs (GEMMs: and the fraction of their own floor; {peer}.up and .down: its "
                "GEMMs on the same tokens in expert order):\n\n",
                _grid([(s, p.removeprefix("tmoe.")) for s in shapes for p in timed
                       if any((s, m, p) in rows for m in ms)], ms,
                      lambda label, m: _stage_time(get(label[0], m, _provider(label[1])), label[1]))]
    missed = misses(rows, dtype, stages)
    if missed:
        out += ["\ncells below the goal (fraction < goal), each with its stages alone (graph µs, GEMMs with the "
                "fraction of their own floor):\n\n", *missed]
    return "".join(out)


TRAIN_PEERS = ("grouped_mm", "liger[pinned]", "liger")


def train_tables(rows: dict) -> str:
    """The training run's tables (Markdown): fwd+bwd ms eager and as a CUDA-graph replay, and peak
    MiB, tmoe / each peer that ran; tmoe's fraction of the floor and speedup over grouped_mm (eager)."""
    peers = [p for p in TRAIN_PEERS if any(key[2] == p for key in rows)]
    shapes, ms = _shapes_and_ms(rows)

    def value(r: dict | None, field: str, fmt: str) -> str:
        v = (r or {}).get(field) or "n/a"  # rows measured before a field existed hold n/a
        return "n/a" if v.startswith("n/a") else format(float(v), fmt)

    def joined(field: str, fmt: str, providers: Sequence[str] = ("tmoe", *peers)):
        return lambda s, m: (s, m, "tmoe") in rows and " / ".join(
            value(rows.get((s, m, p)), field, fmt) for p in providers)

    def own(s, m):
        r = rows.get((s, m, "tmoe"))
        speedup = value(r, "speedup_vs_grouped_mm", ".2f") if r else "n/a"
        return r and f"{value(r, 'fraction', '.2f')} ({speedup}{'x' if speedup != 'n/a' else ''})"

    names = " / ".join(("tmoe", *peers))
    captured = ("tmoe", *(p for p in peers if any(key[2] == p and value(r, "graph_ms", "") != "n/a"
                                                  for key, r in rows.items())))
    return "".join([f"forward+backward ms, {names}:\n\n", _grid(shapes, ms, joined("fwd_bwd_ms", ".1f")),
                    f"\nthe step captured in a CUDA graph, replay ms, {' / '.join(captured)}:\n\n",
                    _grid(shapes, ms, joined("graph_ms", ".1f", captured)),
                    f"\npeak MiB, {names}:\n\n", _grid(shapes, ms, joined("peak_mib", ".0f")),
                    "\ntmoe's fraction of the floor (speedup over grouped_mm):\n\n", _grid(shapes, ms, own)])


def _provider(stage: str) -> str:
    """The CSV provider of a stage row: "up" is tmoe's ("tmoe.up"), "grouped_mm.up" a peer's."""
    return stage if "." in stage else f"tmoe.{stage}"


def _stage_key(provider: str) -> tuple[bool, int]:
    """tmoe's stages first, then the peer's GEMMs, each in the layer's order."""
    who, stage = provider.split(".", 1)
    return who != "tmoe", (STAGE_ORDER + (stage,)).index(stage)


def _stage_time(row: dict | None, stage: str) -> str | None:
    """A stage's graph µs, the GEMMs' (tmoe's or a peer's) with the fraction of their own floor:
    "191 (0.99)"."""
    t = _num(row, "graph_us")
    return t and (f"{t} ({_num(row, 'fraction')})" if stage.rsplit(".", 1)[-1] in ("up", "down") else t)


def goal(dtype: str, m: int) -> float | None:
    """The layer's fraction-of-floor goal at ``m`` tokens (None: no goal for ``dtype``)."""
    return next((g for top, g in GOALS[dtype] if m <= top), None) if dtype in GOALS else None


def misses(rows: dict, dtype: str, stages: Sequence[str]) -> list[str]:
    """One Markdown list line per cell whose tmoe fraction is below ``goal``, with its stages."""
    shapes, ms = _shapes_and_ms(rows)
    lines = []
    for s in shapes:
        for m in ms:
            frac, want = _num(rows.get((s, m, "tmoe")), "fraction"), goal(dtype, m)
            if frac is None or want is None or float(frac) >= want:
                continue
            parts = [f"{st} {t}" for st in stages if (t := _stage_time(rows.get((s, m, f"tmoe.{st}")), st))]
            layer = _num(rows[(s, m, "tmoe")], "graph_us")
            lines.append(f"- {s} M={m}: {frac} < {want:.2f}, {layer} µs" + (f"; {', '.join(parts)}" if parts else "")
                         + "\n")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tmoe tables", description=__doc__)
    p.add_argument("csv", type=Path, help="bench_moe.csv (python -m tmoe bench) or bench_train.csv (bench-train)")
    p.add_argument("--commit", required=True, help="the run's commit (the CSV's commit column), or a comma list of them")
    p.add_argument("--dtype", default="bf16")
    args = p.parse_args(argv)
    if not args.csv.is_file():
        p.error(f"no such file: {args.csv}")
    rows = load_rows(args.csv, args.commit, args.dtype)
    if not rows:
        print(f"no rows of commit {args.commit} and dtype {args.dtype} in {args.csv}")
        return 1
    training = "fwd_bwd_ms" in next(iter(rows.values()))
    print(train_tables(rows) if training else tables(rows, args.dtype), end="")
    return 0
