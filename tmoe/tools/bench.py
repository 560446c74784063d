"""Whole-layer MoE benchmark: tmoe against the roofline and its peers, a ``torch._grouped_mm`` MoE and a
per-expert loop in bf16, a ``torch._scaled_grouped_mm`` MoE (row-wise scales) in the fp8 modes.

floor = max(bytes / copy bandwidth, flops / matmul rate), both ceilings measured at the start of
the run, with bytes = 3NK weights of every touched expert + x read and output written (M*K
each) and flops = 2 * M * topk * 3NK; fraction = floor / measured time (the graph replay when
captured, else eager). Results: a line per row as it is measured and a Markdown table on stdout;
with ``--csv PATH`` the rows are appended to PATH as they are measured (keyed by GPU, versions and
commit), with ``--out DIR`` the report ``<date>_<gpu>.md`` and the plot ``roofline.png`` are
written into DIR (fp8 and low-bit modes add a ``_<dtype>`` suffix to both). Nothing is written
without them; recording a run in the repository: ``--csv bench/results/bench_moe.csv --out
bench/results``. Weight-only low-bit
modes (``--dtype int4|int8|mxfp4``, ``tmoe.tools.low_bit``) count the scheme's weight bytes
(codes, scales, zero points) against the bf16 matmul rate, with the bf16 tmoe layer beside them.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

import tmoe
from tmoe.config import ROUTES as LAYER_ROUTES
from tmoe.tools import peers, stage_calls, timing
from tmoe.tools.inputs import SHAPES, RoutedInputs, Shape, make_inputs, make_weights
from tmoe.tools.low_bit import LOW_BIT_DTYPES, value_bytes
from tmoe.tools.results import Env, Measurement, Row, append_csv, git_commit, markdown_table, row_cells, write_plot
from tmoe.tools.timing import Call

DTYPES = ("bf16", "fp8_block", "fp8_token", *LOW_BIT_DTYPES)
DEFAULT_MS = (1, 8, 64, 256, 1024, 4096, 16384)
QUICK_MS = (1, 64, 1024)
ROUTES = ("auto", *LAYER_ROUTES)  # auto: the layer's own choice by token count
PROVIDERS = ("tmoe", "grouped_mm", "scaled_grouped_mm", "loop")  # bf16 runs skip the fp8 peer, fp8 runs the bf16 ones


def count_touched(topk_ids: torch.Tensor, e: int) -> int:
    """Distinct experts in ``topk_ids`` (syncs; call outside timing)."""
    return int(torch.bincount(topk_ids.reshape(-1).long(), minlength=e).gt(0).sum())


def layer_traffic(s: Shape, m: int, touched: float, weight_bytes: float = 2, act_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops) of the whole layer at M=m with ``touched`` experts read, ``weight_bytes`` per weight value."""
    return touched * 3 * s.n * s.k * weight_bytes + 2 * m * s.k * act_bytes, 2.0 * m * s.topk * 3 * s.n * s.k


def stage_traffic(stage: str, s: Shape, m: int, touched: float, weight_bytes: float = 2,
                  act_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops) of one tmoe stage; ``act_bytes`` per activation value a GEMM or the
    reduce reads (fp8: 1; GEMM outputs, the reduce's output and the quantizations' inputs are
    bf16); int32 ids and float32 router weights and scales are 4 bytes. "rows": the grouped
    core's copy of each slot's row (and fp8 scale) into expert order, padding not counted."""
    slots = m * s.topk
    table = {
        "align": (8 * slots, 0.0),
        "rows": (2 * slots * s.k * act_bytes + (8 * slots if act_bytes == 1 else 0), 0.0),
        "up": (touched * 2 * s.n * s.k * weight_bytes + m * s.k * act_bytes + slots * s.n * 2, 4.0 * slots * s.n * s.k),
        "down": (touched * s.n * s.k * weight_bytes + slots * (s.n * act_bytes + s.k * 2), 2.0 * slots * s.n * s.k),
        "reduce": ((slots + m) * s.k * 2 + 8 * slots, 2.0 * slots * s.k),
        "quant": (m * s.k * 3, 0.0),
        "quant_inter": (slots * s.n * 3, 0.0),
    }
    return table[stage]


def floor_us(nbytes: float, flops: float, copy_bw: float, flop_rate: float) -> float:
    """max(bytes / bandwidth, flops / rate) in microseconds."""
    return 1e6 * max(nbytes / copy_bw, flops / flop_rate)


def guarded(fn: Callable[[], float]) -> Measurement:
    """fn() in µs, or the error's type name when it raises: a failing provider never ends the run."""
    try:
        return float(fn())
    except Exception as err:  # noqa: BLE001
        print(f"    {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}", flush=True)
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001  (a broken capture may leave an error behind)
            pass
        return type(err).__name__


def _report(row: Row, t0: float) -> Row:
    """Print one progress line for ``row`` and return it."""
    c = row_cells(row)
    print(f"[{time.perf_counter() - t0:6.1f} s] {c[0]} M={c[1]} {c[2]}: graph {c[3]}, eager {c[4]}, floor {c[5]} (µs), "
          f"fraction {c[6]}", flush=True)
    return row


def _time_both(calls: list[Call], syncs: bool, args: argparse.Namespace) -> tuple[Measurement, Measurement]:
    """(graph µs or "syncs", eager µs), each guarded."""
    graph = "syncs" if syncs else guarded(lambda: timing.time_graph(calls, args.rounds))
    eager = guarded(lambda: timing.time_eager(calls, args.rep_ms))
    torch.cuda.empty_cache()
    return graph, eager


def bench_stages(s: Shape, m: int, weights: tuple[torch.Tensor | None, ...], sets: list[RoutedInputs],
                 touched: float, args: argparse.Namespace, ceil: timing.Ceilings, t0: float) -> Iterator[Row]:
    """Rows ``tmoe.<stage>``: each stage op timed alone on the route and block_m the layer uses;
    ``weights`` (w1, w1_scale, w2, w2_scale): bf16 with None scales, or the fp8 modes' codes and
    scales. Then, where the run has the peer of ``stage_calls.GEMM_PEERS``, its two GEMMs alone on the
    same tokens (``<peer>.up``, ``<peer>.down``: ``stage_calls.peer_gemm_calls``)."""
    fp8 = args.dtype != "bf16"
    w1, w1_scale, w2, w2_scale = weights
    block_shape = (128, 128) if args.dtype == "fp8_block" else None
    try:
        if stage_calls.takes_grouped_route(w1, w2, m, s.topk, args.dtype):
            calls = stage_calls.grouped_stage_calls(w1, w2, sets, args.dtype, w1_scale, w2_scale)
        else:
            block_m = tmoe.get_config(m, s.e, s.n, s.k, s.topk, w1.device, quant="fp8_w8a8" if fp8 else None,
                                      block_shape=block_shape).block_m
            calls = stage_calls.stage_calls(w1, w2, sets, block_m, args.dtype, w1_scale, w2_scale)
        if stage_calls.GEMM_PEERS.get(args.dtype) in args.providers:
            calls |= stage_calls.peer_gemm_calls(w1, w2, sets, args.dtype, w1_scale, w2_scale)
    except Exception as err:  # noqa: BLE001
        print(f"    stages failed: {type(err).__name__}: {err}", flush=True)
        return
    for stage, calls_of_stage in calls.items():
        provider = stage if "." in stage else f"tmoe.{stage}"
        nbytes, flops = stage_traffic(stage.rsplit(".", 1)[-1], s, m, touched, value_bytes(args.dtype), 1 if fp8 else 2)
        floor = floor_us(nbytes, flops, ceil.copy_bw, ceil.rate(args.dtype))
        graph, eager = _time_both(calls_of_stage, False, args)
        yield _report(Row(s, args.dtype, m, provider, graph, eager, floor, nbytes, flops, touched), t0)


def bench_shape(s: Shape, ms: Sequence[int], args: argparse.Namespace, ceil: timing.Ceilings,
                t0: float) -> Iterator[Row]:
    """Every M and provider of one shape on fresh random weights, freed before returning."""
    dev = torch.device("cuda")
    w1, w2 = make_weights(s.e, s.n, s.k, dev)
    providers = peers.with_routes(peers.providers(args.dtype, w1, w2, args.providers), args.routes)
    if args.batch_invariant:
        providers = peers.batch_invariant(providers)
    per_value = value_bytes(args.dtype)
    stage_weights = None
    if args.stages and args.dtype == "bf16":
        stage_weights = (w1, None, w2, None)
    elif args.stages and args.dtype.startswith("fp8"):
        stage_weights = (*peers.quantize_fp8(w1, args.dtype), *peers.quantize_fp8(w2, args.dtype))
    del w1, w2  # the providers hold what they need (the fp8 and low-bit ones their own quantized copies)
    for m in ms:
        sets = make_inputs(m, s.e, s.k, s.topk, args.sets, dev)
        touched = statistics.mean(count_touched(r.topk_ids, s.e) for r in sets)
        nbytes, flops = layer_traffic(s, m, touched, per_value)
        floor = floor_us(nbytes, flops, ceil.copy_bw, ceil.rate(args.dtype))
        for p in providers:
            if p.name == "loop" and m > args.loop_max_m:
                continue
            graph, eager = _time_both([functools.partial(p.fn, r) for r in sets], p.syncs, args)
            yield _report(Row(s, args.dtype, m, p.name, graph, eager, floor, nbytes, flops, touched), t0)
        if stage_weights is not None:
            yield from bench_stages(s, m, stage_weights, sets, touched, args, ceil, t0)
        del sets
    del providers, stage_weights
    torch.cuda.empty_cache()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tmoe bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="mixtral,qwen3,deepseek", help=f"comma list of {','.join(SHAPES)}")
    p.add_argument("--ms", default=None, help="comma list of token counts (default %s)" % ",".join(map(str, DEFAULT_MS)))
    p.add_argument("--dtype", default="bf16", choices=DTYPES)
    p.add_argument("--csv", type=Path, default=None, metavar="PATH",
                   help="append each row to this CSV as it is measured (default: none, the rows are printed; "
                        "a developer recording a run passes bench/results/bench_moe.csv)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="also write the Markdown report and the roofline plot into DIR (default: none)")
    p.add_argument("--quick", action="store_true", help="M in %s only" % ",".join(map(str, QUICK_MS)))
    p.add_argument("--providers", default=",".join(PROVIDERS),
                   help="comma list of tmoe,grouped_mm,loop (bf16) and tmoe,scaled_grouped_mm (fp8)")
    p.add_argument("--loop-max-m", type=int, default=1024, help="run the loop peer only up to this M")
    p.add_argument("--stages", action="store_true", help="also time each tmoe stage alone (bf16, fp8)")
    p.add_argument("--sets", type=int, default=4, help="rotated input sets")
    p.add_argument("--rounds", type=int, default=20, help="minimum timed graph rounds")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time (ms)")
    p.add_argument("--routes", default="auto",
                   help="comma list of auto,sorted,direct,slots,fused,grouped: tmoe by token count, or forced to its aligned, "
                        "decode, per-slot, fused decode or grouped-core path (rows tmoe[sorted], tmoe[direct], ...)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="run tmoe under tmoe.batch_invariant() (rows tmoe[invariant], ...): what the mode costs")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse --short HEAD)")
    args = p.parse_args(argv)
    shapes, names = args.shapes.split(","), tuple(args.providers.split(","))
    bad = [s for s in shapes if s not in SHAPES] + [n for n in names if n not in PROVIDERS]
    if bad:
        p.error(f"unknown shapes or providers: {', '.join(bad)}")
    args.routes = tuple(args.routes.split(","))
    if any(r not in ROUTES for r in args.routes):
        p.error(f"routes must be among {', '.join(ROUTES)}")
    args.shapes, args.providers = [SHAPES[s] for s in shapes], names
    args.ms = [int(m) for m in args.ms.split(",")] if args.ms else list(QUICK_MS if args.quick else DEFAULT_MS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (``python -m tmoe bench``); returns the exit status."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m tmoe bench needs a CUDA device", flush=True)
        return 1
    import triton

    now, t0 = datetime.datetime.now(), time.perf_counter()
    env = Env(now.isoformat(timespec="seconds"), torch.cuda.get_device_name(), torch.__version__, triton.__version__,
              args.commit or git_commit())
    print(f"# {env.gpu}, torch {env.torch}, triton {env.triton}, commit {env.commit}, {args.dtype}", flush=True)
    if args.stages and args.dtype not in ("bf16", "fp8_block", "fp8_token"):
        print("# --stages times bf16 and fp8 only: skipped", flush=True)
    ceil = timing.measure_ceilings(with_fp8=args.dtype.startswith("fp8"))
    ceil_text = ceil.describe()
    print(f"# ceilings: {ceil_text}", flush=True)
    for path in (args.csv.parent if args.csv else None, args.out):
        if path is not None:
            path.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.dtype == "bf16" else f"_{args.dtype}"
    rows: list[Row] = []
    for shape in args.shapes:
        try:
            for row in bench_shape(shape, [m for m in args.ms if m <= shape.max_m], args, ceil, t0):
                rows.append(row)
                if args.csv:
                    append_csv(args.csv, [row], env)  # written as measured: a cut-off run keeps them
        except Exception as err:  # noqa: BLE001  (e.g. out of memory for one shape's weights)
            print(f"# {shape.name} stopped: {type(err).__name__}: {err}", flush=True)
            torch.cuda.empty_cache()
        if args.out:
            md = args.out / f"{now:%Y-%m-%d}_{re.sub(r'[^A-Za-z0-9.-]+', '_', env.gpu)}{suffix}.md"
            md.write_text(f"# tmoe bench_moe, {args.dtype}\n\n{env.gpu}, torch {env.torch}, triton {env.triton}, "
                          f"commit {env.commit}, {env.date}\n\nCeilings: {ceil_text}\n\n{markdown_table(rows)}")
            write_plot(args.out / f"roofline{suffix}.png", [r for r in rows if "." not in r.provider])
    print("\n" + markdown_table(rows), flush=True)
    written = ", ".join(str(p) for p in (args.csv, args.out) if p) or "nothing (no --csv, no --out)"
    print(f"# wrote {written} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0
