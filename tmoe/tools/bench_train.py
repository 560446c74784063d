"""Training benchmark (``python -m tmoe bench-train``): one forward+backward step of the MoE layer
(gradients of x, w1, w2 and topk_weights) for tmoe, transformers' ``torch._grouped_mm`` experts
path in plain autograd and Liger-Kernel's ``LigerFusedMoEFunction``, in the same run.

Time: the median of ``triton.testing.do_bench`` (CUDA events, L2 flushed per call) over eager steps
``out = layer(...)``, ``torch.autograd.grad(out, params, grad_out)``, which includes the host's
launch and dispatch time where it exceeds the GPU's; and the same step captured whole in a CUDA
graph, the median of its replays (``timing.time_graph``): the GPU's time alone, n/a where the
provider cannot be captured (its note says why). Peak: ``max_memory_allocated`` over one step minus
the memory held before it (weights, inputs, grad_out), i.e. activations, workspace and the
returned output and gradients. floor = max(3 x forward FLOPs / bf16 matmul rate, bytes / copy
bandwidth), both ceilings measured at the start; forward FLOPs = 2 M topk 3NK; bytes = the
touched experts' weights three times (forward read, backward read, gradient write) + x, out,
grad_out and dx once. fraction = floor / time. Each peer's output and gradients are checked
against tmoe's once per cell (max relative-norm error; > 5e-2 is flagged "DISAGREES").
Liger's kernels autotune per shape (~200 compiles each); by default they are pinned to one config
(``LIGER_FUSED_MOE_AUTOTUNE=0``, row "liger[pinned]"), ``--liger-autotune`` lets them tune ("liger").
Each provider's layer and step are in ``train_peers.py``. Results: the table on stdout; ``--csv
PATH`` also appends the rows to PATH as each cell is measured, keyed by GPU, versions and commit.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from tmoe.tools.bench import count_touched
from tmoe.tools.inputs import Shape, make_weights
from tmoe.tools.train_peers import make_layer, provider_name, step_fn
from tmoe.tools.results import Env, git_commit
from tmoe.tools.timing import measure_ceilings, peak_mib, time_graph, time_ms

SHAPES = {
    "qwen3": Shape("qwen3", 128, 768, 2048, 8),
    "mixtral": Shape("mixtral", 8, 14336, 4096, 2),
    "deepseek": Shape("deepseek", 256, 2048, 7168, 8),
    "gpt_oss": Shape("gpt_oss", 32, 2880, 2880, 4),  # GPT-OSS-20B's experts (without their biases)
}
TINY = Shape("tiny", 4, 32, 64, 2)
PROVIDERS = ("tmoe", "tmoe_recompute", "grouped_mm", "liger")
DEFAULT_MS = (1024, 4096, 16384)
# Steps that cannot be captured in a CUDA graph, and why: a failed capture leaves the process's CUDA
# RNG state unusable, so they are not tried.
NOT_CAPTURABLE = {"liger": "Liger-Kernel's step reads its tile count on the host (.item())"}
DISAGREE = 5e-2
HEADER = ["shape", "M", "provider", "fwd+bwd ms", "graph ms", "peak MiB", "floor ms", "fraction",
          "speedup vs grouped_mm", "max rel err vs tmoe"]
CSV_FIELDS = ["date", "gpu", "torch", "triton", "commit", "shape", "E", "N", "K", "topk", "dtype", "M", "provider",
              "fwd_bwd_ms", "graph_ms", "peak_mib", "floor_ms", "fraction", "speedup_vs_grouped_mm", "max_rel_err",
              "note"]

def _err_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


def _recover() -> None:
    """Free what a failed cell left behind (an OOM, a failed launch), so the run goes on."""
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def graph_ms(name: str, step: Callable[[], tuple], device: torch.device) -> tuple[float | None, str]:
    """(median ms of provider ``name``'s ``step`` captured whole in a CUDA graph and replayed, "") on
    CUDA; (None, why) where it cannot be captured or the capture fails, and (None, "") on CPU."""
    if device.type != "cuda":
        return None, ""
    if name in NOT_CAPTURABLE:
        return None, f"graph: {NOT_CAPTURABLE[name]}"
    try:
        return time_graph([step]) / 1e3, ""
    except Exception as err:  # noqa: BLE001  (a capture error is the peer's, reported in its cell)
        _recover()
        return None, f"graph: {_err_line(err)}"


def rel_err(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 26) -> float:
    """||a - b|| / ||b|| in float64, in chunks (no full-size float temporaries)."""
    a, b = a.reshape(-1), b.reshape(-1)
    num = den = 0.0
    for i in range(0, b.numel(), chunk):
        x, y = a[i:i + chunk].double(), b[i:i + chunk].double()
        num += float((x - y).square().sum())
        den += float(y.square().sum())
    return (num / den) ** 0.5 if den > 0 else num ** 0.5


def floor_ms(s: Shape, m: int, touched: int, copy_bw: float, flop_rate: float) -> float:
    flops = 3 * 2.0 * m * s.topk * 3 * s.n * s.k
    nbytes = 3 * touched * 3 * s.n * s.k * 2 + 4 * m * s.k * 2
    return 1e3 * max(flops / flop_rate, nbytes / copy_bw)


def _fmt(v: float | None, f: str) -> str:
    return "n/a" if v is None else f.format(v)


def bench_cell(s: Shape, m: int, w1: torch.Tensor, w2: torch.Tensor, args: argparse.Namespace,
               ceil: tuple[float, float], t0: float) -> list[dict]:
    device = w1.device
    x = torch.randn(m, s.k, dtype=torch.bfloat16, device=device)
    tw, ids = torch.topk(torch.randn(m, s.e, device=device).softmax(-1), s.topk)
    tw, ids = tw.contiguous(), ids.to(torch.int32).contiguous()
    grad_out = torch.randn(m, s.k, dtype=torch.bfloat16, device=device)
    params = (x.requires_grad_(), w1, w2, tw.requires_grad_())
    floor = floor_ms(s, m, count_touched(ids, s.e), *ceil)
    rows, ref = [], None
    for name in args.providers:
        row = dict(shape=s.name, M=m, provider=provider_name(name, args), ms=None, graph=None, peak=None,
                   floor=floor, err=None, note="")
        try:
            step = step_fn(make_layer(name, ids, args), params, grad_out)
            res = step()  # compile / autotune, outside the timing
            if ref is None and name == "tmoe":
                ref = res
            elif ref is not None:
                try:  # a check that fails (memory: two sets of weight gradients) still leaves the timing
                    errs = [rel_err(a, b) for a, b in zip(res, ref)]
                    row["err"] = max(errs)
                    print(f"    {row['provider']} vs tmoe rel err out, dx, dw1, dw2, dtopk_weights: "
                          + ", ".join(f"{e:.2e}" for e in errs)
                          + (" DISAGREES" if not row["err"] <= DISAGREE else ""), flush=True)
                    if not row["err"] <= DISAGREE:
                        row["note"] = "DISAGREES with tmoe"
                except Exception as err:  # noqa: BLE001
                    row["note"] = f"check failed: {_err_line(err)}"
                    print(f"    {row['provider']}: {row['note']}", flush=True)
                    _recover()
            del res
            row["peak"] = peak_mib(step, device)
            row["ms"] = time_ms(step, device, args.rep_ms)
            row["graph"], graph_note = graph_ms(name, step, device)
            row["note"] = "; ".join(n for n in (row["note"], graph_note) if n)
        except Exception as err:  # noqa: BLE001  (OOM or a failing peer: reported in its cell, the run goes on)
            row["note"] = _err_line(err)
            print(f"    {row['provider']}: {row['note']}", flush=True)
            _recover()
        rows.append(row)
        print(f"[{time.perf_counter() - t0:6.1f} s] {s.name} M={m} {row['provider']}: {_fmt(row['ms'], '{:.3f}')} ms, "
              f"graph {_fmt(row['graph'], '{:.3f}')} ms, peak {_fmt(row['peak'], '{:.0f}')} MiB, "
              f"floor {floor:.3f} ms", flush=True)
    del ref
    base = next((r["ms"] for r in rows if r["provider"] == "grouped_mm"), None)
    for r in rows:
        r["fraction"] = None if not r["ms"] else r["floor"] / r["ms"]
        r["speedup"] = None if not (base and r["ms"]) else base / r["ms"]
    _recover()
    return rows


def cells(r: dict) -> list[str]:
    return [r["shape"], str(r["M"]), r["provider"], _fmt(r["ms"], "{:.3f}") + (f" ({r['note']})" if r["ms"] is None
                                                                               else ""),
            _fmt(r["graph"], "{:.3f}"), _fmt(r["peak"], "{:.0f}"), f"{r['floor']:.3f}", _fmt(r["fraction"], "{:.2f}"),
            _fmt(r["speedup"], "{:.2f}"),
            _fmt(r["err"], "{:.1e}") + (" DISAGREES" if r["err"] is not None and not r["err"] <= DISAGREE else "")]


def markdown(rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(cells(r)) + " |" for r in rows]) + "\n"


def append_csv(path: Path, rows: Sequence[dict], env: Env, shapes: dict[str, Shape]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(CSV_FIELDS)
        for r in rows:
            s = shapes[r["shape"]]
            w.writerow([env.date, env.gpu, env.torch, env.triton, env.commit, s.name, s.e, s.n, s.k, s.topk, "bf16",
                        r["M"], r["provider"], _fmt(r["ms"], "{:.4f}"), _fmt(r["graph"], "{:.4f}"),
                        _fmt(r["peak"], "{:.1f}"),
                        f"{r['floor']:.4f}", _fmt(r["fraction"], "{:.3f}"), _fmt(r["speedup"], "{:.3f}"),
                        _fmt(r["err"], "{:.3e}"), r["note"]])


def ceilings(device: torch.device) -> tuple[float, float, str]:
    """(copy bytes/s, bf16 FLOP/s, text): measured on CUDA, nominal placeholders on CPU."""
    if device.type != "cuda":
        return 1e10, 1e11, "CPU: nominal 10 GB/s, 100 GFLOP/s (not measured)"
    c = measure_ceilings(with_fp8=False, trials=3)
    return c.copy_bw, c.bf16_flops, c.describe()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tmoe bench-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3,mixtral,deepseek", help=f"comma list of {','.join(SHAPES)}")
    p.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)), help="comma list of token counts")
    p.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma list of {','.join(PROVIDERS)}")
    p.add_argument("--csv", type=Path, default=None, metavar="PATH",
                   help="append each cell's rows to this CSV as measured (default: none, the table is printed; a "
                        "developer recording a run passes bench/results/bench_train.csv)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time per cell (ms)")
    p.add_argument("--liger-autotune", action="store_true",
                   help="let Liger's kernels autotune (about 200 Triton compiles per shape) instead of one pinned config")
    p.add_argument("--tiny", action="store_true", help="a tiny shape at M=8,16 (runs on CPU under the interpreter)")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse --short HEAD)")
    args = p.parse_args(argv)
    names = tuple(args.providers.split(","))
    shapes = [TINY] if args.tiny else [SHAPES.get(n) for n in args.shapes.split(",")]
    if None in shapes or any(n not in PROVIDERS for n in names):
        p.error(f"shapes must be among {','.join(SHAPES)}, providers among {','.join(PROVIDERS)}")
    if "tmoe" in names:
        names = ("tmoe", *(n for n in names if n != "tmoe"))  # the reference of the checks runs first
    args.providers, args.shapes = names, shapes
    args.ms = [8, 16] if args.tiny else [int(m) for m in args.ms.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        print("bench-train needs a CUDA device (or --tiny)", flush=True)
        return 1
    import triton

    now, t0 = datetime.datetime.now(), time.perf_counter()
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    env = Env(now.isoformat(timespec="seconds"), gpu, torch.__version__, triton.__version__, args.commit or git_commit())
    print(f"# bench-train: {env.gpu}, torch {env.torch}, triton {env.triton}, commit {env.commit}, bf16, "
          f"providers {','.join(provider_name(n, args) for n in args.providers)}, rep {args.rep_ms:g} ms", flush=True)
    copy_bw, flop_rate, text = ceilings(device)
    print(f"# ceilings: {text}", flush=True)
    print("# peak MiB: allocated above what was held before the step (weights, x, routing, grad_out): activations, "
          "workspace, output and gradients", flush=True)
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
    shapes = {s.name: s for s in args.shapes}
    rows: list[dict] = []
    for s in args.shapes:
        w1 = w2 = None
        try:
            torch.manual_seed(0)
            w1, w2 = make_weights(s.e, s.n, s.k, device)
            w1.requires_grad_(), w2.requires_grad_()
            for m in args.ms:
                try:
                    cell = bench_cell(s, m, w1, w2, args, (copy_bw, flop_rate), t0)
                except Exception as err:  # noqa: BLE001
                    print(f"# {s.name} M={m} stopped: {_err_line(err)}", flush=True)
                    _recover()
                    continue
                rows += cell
                if args.csv:
                    append_csv(args.csv, cell, env, shapes)  # as measured: a cut-off run keeps them
        except Exception as err:  # noqa: BLE001  (e.g. out of memory for one shape's weights)
            print(f"# {s.name} stopped: {_err_line(err)}", flush=True)
        del w1, w2
        _recover()
    print(f"\n## bench-train: {env.gpu}, torch {env.torch}, triton {env.triton}, commit {env.commit}\n", flush=True)
    print(markdown(rows), flush=True)
    print(f"# wrote {args.csv or 'no CSV (no --csv)'} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0
