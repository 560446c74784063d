"""Where does a large-M forward lose time? Nsight Compute's counters for every kernel of one tmoe
layer forward per cell (``shape:dtype:M``; shapes of ``tmoe.tools.inputs.SHAPES``, dtypes bf16,
fp8_token, fp8_block). ``run`` calls each cell's forward three times, then once inside a
cudaProfilerStart/Stop range opened by a marker fill kernel; ``report`` reads ncu's raw CSV and
prints, per cell, each kernel's time, SM and DRAM throughput (% of peak) and its largest warp
stall reasons (cycles per issued instruction). GPU only:

    ncu --clock-control none --profile-from-start off --csv --page raw \\
        --metrics $(python bench/repro_forward_profile.py metrics) \\
        python bench/repro_forward_profile.py run qwen3:bf16:4096 deepseek:fp8_token:4096 > ncu.csv
    python bench/repro_forward_profile.py report ncu.csv
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

STALLS = ("long_scoreboard", "barrier", "wait", "math_pipe_throttle", "mio_throttle", "lg_throttle",
          "short_scoreboard", "membar", "sleeping", "dispatch_stall", "selected", "not_selected", "no_instruction",
          "imc_miss", "drain", "branch_resolving", "misc", "tex_throttle")
STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
METRICS = ("gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           *(STALL.format(s) for s in STALLS))
MARKER = "FillFunctor"  # the fill kernel that opens each profiled range
CELL = "CELL "


def run(cells: list[str]) -> None:
    """Profile one forward per ``shape:dtype:M`` cell (weights made once per shape)."""
    import torch

    from tmoe.tools import peers
    from tmoe.tools.inputs import SHAPES, make_inputs, make_weights

    dev = torch.device("cuda")
    marker = torch.zeros(1, device=dev)
    by_shape: dict[str, list[tuple[str, int]]] = {}
    for cell in cells:
        shape, dtype, m = cell.split(":")
        by_shape.setdefault(shape, []).append((dtype, int(m)))
    for shape, runs in by_shape.items():
        s = SHAPES[shape]
        w1, w2 = make_weights(s.e, s.n, s.k, dev)
        for dtype, m in runs:
            (provider,) = peers.providers(dtype, w1, w2, ("tmoe",))
            (inputs,) = make_inputs(m, s.e, s.k, s.topk, 1, dev)
            for _ in range(3):
                provider.fn(inputs)
            torch.cuda.synchronize()
            print(f"{CELL}{shape} {dtype} {m}", flush=True)
            torch.cuda.cudart().cudaProfilerStart()
            marker.fill_(1.0)
            provider.fn(inputs)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        del w1, w2
        torch.cuda.empty_cache()


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else float("nan")


def report(path: Path, top: int = 3) -> list[str]:
    """The per-cell kernel lines of ncu's raw CSV at ``path`` (``run``'s stdout mixed in)."""
    lines = path.read_text().splitlines()
    cells = [line[len(CELL):] for line in lines if line.startswith(CELL)]
    rows = list(csv.reader(line for line in lines if line.startswith('"')))
    if not rows:
        raise ValueError(f"{path}: no ncu CSV rows (run ncu with --csv --page raw)")
    col = {name: i for i, name in enumerate(rows[0])}
    missing = [m for m in ("Kernel Name", *METRICS[:3]) if m not in col]
    if missing:
        raise ValueError(f"{path}: ncu collected no {', '.join(missing)}")
    out, cell = [], -1
    for row in rows[1:]:
        name = row[col["Kernel Name"]]
        if not row[0].strip().isdigit():  # the units row
            continue
        if MARKER in name:
            cell += 1
            out.append(f"== {cells[cell] if cell < len(cells) else '?'}")
            continue
        stalls = sorted(((_number(row[col[STALL.format(s)]]), s) for s in STALLS if STALL.format(s) in col),
                        reverse=True)
        worst = ", ".join(f"{s} {v:.1f}" for v, s in stalls[:top])
        out.append(f"{name[:28]:28s} {_number(row[col[METRICS[0]]]) / 1e3:9.1f} us  "
                   f"SM {_number(row[col[METRICS[1]]]):5.1f}%  DRAM {_number(row[col[METRICS[2]]]):5.1f}%  "
                   f"stalls/issue {sum(v for v, _ in stalls):5.1f}: {worst}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("metrics", help="print the --metrics list for ncu")
    p_run = sub.add_parser("run", help="the profiled forwards (under ncu)")
    p_run.add_argument("cells", nargs="+", help="shape:dtype:M, e.g. qwen3:bf16:4096")
    p_report = sub.add_parser("report", help="the per-kernel table of ncu's raw CSV")
    p_report.add_argument("csv", type=Path)
    args = parser.parse_args()
    if args.command == "metrics":
        print(",".join(METRICS))
    elif args.command == "run":
        run(args.cells)
    else:
        print("\n".join(report(args.csv)))


if __name__ == "__main__":
    main()
