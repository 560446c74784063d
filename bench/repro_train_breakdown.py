"""Where does a tmoe training step's time go? Times the layer's forward and each backward op
(``torch.ops.tmoe.moe_grad_*``, called as the layer's backward calls them) at the Qwen3-30B-A3B,
Mixtral-8x7B, DeepSeek-V3 and GPT-OSS-20B layer shapes (bf16, random top-k routing; the storage
options of transformers' GPT-OSS each a flag: ``--transposed`` weights read as transposed views,
``--interleaved`` gate/up rows, ``--bias``, ``--activation swigluoai``), and prints each op's
milliseconds, its FLOPs (the registered FLOP formulas, counted by ``FlopCounterMode``), its
TFLOP/s and that rate over the measured bf16 matmul rate; then the sum beside one whole
forward+backward step and ``torch._grouped_mm``'s step. GPU only:
``python bench/repro_train_breakdown.py [--ms 4096] [--shapes qwen3 mixtral deepseek gpt_oss] [--transposed]
[--interleaved] [--bias] [--activation silu] [--out bench/results/train_breakdown.csv]``."""
from __future__ import annotations

import argparse
import csv
import datetime
from pathlib import Path
from typing import Callable

import torch
import triton
from torch.utils.flop_counter import FlopCounterMode

import tmoe
from tmoe.config.backward import grad_block_m
from tmoe.modular.call import LayerArgs
from tmoe.tools.bench_train import SHAPES
from tmoe.tools.train_peers import grouped_mm_layer, step_fn
from tmoe.tools.inputs import make_weights
from tmoe.tools.results import git_commit
from tmoe.tools.timing import measure_ceilings


def _ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def _flops(fn: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


FIELDS = ["date", "gpu", "torch", "triton", "commit", "shape", "E", "N", "K", "topk", "M", "layout", "op", "ms",
          "tflop", "tflop_s", "fraction_of_mm", "mm_tflop_s"]


def run_shape(name: str, m: int, rate: float, args: argparse.Namespace) -> list[list]:
    """Print the shape's breakdown; its rows (FIELDS from "shape" on) for ``--out``."""
    s = SHAPES[name]
    dev, dt = torch.device("cuda"), torch.bfloat16
    w1, w2 = make_weights(s.e, s.n, s.k, dev)
    if args.transposed:  # stored (E, K, 2N) and (E, N, K), read through strides
        w1, w2 = w1.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2)
    b1, b2 = ((0.1 * torch.randn(s.e, 2 * s.n, device=dev, dtype=dt), 0.1 * torch.randn(s.e, s.k, device=dev, dtype=dt))
              if args.bias else (None, None))
    act, inter_leaved = args.activation, args.interleaved
    x = torch.randn(m, s.k, device=dev, dtype=dt)
    tw, ids = torch.topk(torch.randn(m, s.e, device=dev).softmax(-1), s.topk)
    ids = ids.to(torch.int32).contiguous()
    go = torch.randn(m, s.k, device=dev, dtype=dt)
    ops = torch.ops.tmoe
    block_m = grad_block_m(s.e)
    t1, t2 = args.transposed, args.transposed  # dW written in the stored layout, as the layer's backward does
    sorted_ids, expert_ids, npp, offsets = ops.moe_grad_align(ids, block_m, s.e, None, None)
    spec = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts()).spec.as_args()
    call = LayerArgs(x, w1, w2, tw, ids, activation=act, w1_bias=b1, w2_bias=b2, gate_up_interleaved=inter_leaved)
    train_forward = lambda: ops.modular_forward_train(*call, *spec)  # noqa: E731
    preact = train_forward()[1]
    grad_act = lambda saved=None: ops.moe_grad_act(go, x, w1, w2, tw, sorted_ids, expert_ids, npp, block_m, b1, b2,
                                                   act, None, None, inter_leaved, False, None, None, None, saved)
    grad_h, inter, partial = grad_act(preact)
    parts = {
        "forward (layer)": lambda: tmoe.fused_experts(x, w1, w2, tw, ids, activation=act, w1_bias=b1, w2_bias=b2,
                                                      gate_up_interleaved=inter_leaved),
        "forward (saves preact)": train_forward,
        "moe_grad_align": lambda: ops.moe_grad_align(ids, block_m, s.e, None, None),
        "moe_grad_act (recompute + dA)": grad_act,
        "moe_grad_act (saved + dA)": lambda: grad_act(preact),
        "moe_grad_input (dx, dw)": lambda: ops.moe_grad_input(
            grad_h, w1, partial, tw, ids, sorted_ids, expert_ids, npp, block_m, s.e, None, None, False),
        "moe_grad_weight dW1": lambda: ops.moe_grad_weight(grad_h, x, tw, sorted_ids, offsets, s.e, False, False,
                                                           block_m, None, t1),
        "moe_grad_weight dW2": lambda: ops.moe_grad_weight(go, inter, tw, sorted_ids, offsets, s.e, True, False,
                                                           block_m, None, t2),
    }
    if args.bias:
        parts["moe_grad_bias db1"] = lambda: ops.moe_grad_bias(grad_h, tw, sorted_ids, offsets, s.e, False, False, None)
        parts["moe_grad_bias db2"] = lambda: ops.moe_grad_bias(go, tw, sorted_ids, offsets, s.e, True, True, None)
    layout = [f for f in ("transposed", "interleaved", "bias") if getattr(args, f)]
    print(f"{name} M={m} (E={s.e} N={s.n} K={s.k} topk={s.topk}, align block {block_m}, {act}"
          f"{''.join(', ' + f for f in layout)})", flush=True)
    total, rows = 0.0, []
    key = [name, s.e, s.n, s.k, s.topk, m, " ".join([act, *layout])]
    for label, fn in parts.items():
        with torch.no_grad():
            ms, flops = _ms(fn), _flops(fn)
        total += ms
        tflops = flops / ms / 1e9
        print(f"  {label:30s} {ms:8.3f} ms  {flops / 1e12:7.3f} TFLOP  {tflops:6.0f} TFLOP/s  "
              f"{tflops * 1e12 / rate:4.2f} of the mm rate", flush=True)
        rows.append(key + [label, f"{ms:.3f}", f"{flops / 1e12:.3f}", f"{tflops:.0f}", f"{tflops * 1e12 / rate:.2f}"])
    del grad_h, inter, partial, preact
    leaves = (x, w1, w2, tw) + ((b1, b2) if args.bias else ())
    params = tuple(t.requires_grad_() for t in leaves)  # the same leaves: no second copy of the weights
    line = f"  sum of the parts (both forwards, both moe_grad_act) {total:.3f} ms"
    for label, save in (("step tmoe", True), ("step tmoe recompute", False)):
        layer = lambda x, w1, w2, tw, b1=None, b2=None, save=save: tmoe.fused_experts(  # noqa: E731
            x, w1, w2, tw, ids, activation=act, w1_bias=b1, w2_bias=b2, gate_up_interleaved=inter_leaved,
            save_preactivation=save)
        step = _ms(step_fn(layer, params, go))
        line += f"; {label} {step:.3f} ms"
        rows.append(key + [label, f"{step:.3f}", "", "", ""])
    if not (args.bias or inter_leaved or act != "silu"):  # grouped_mm_layer is the plain silu layer
        peer = _ms(step_fn(grouped_mm_layer(ids), params, go))
        line += f"; grouped_mm step {peer:.3f} ms"
        rows.append(key + ["step grouped_mm", f"{peer:.3f}", "", "", ""])
    print(line, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--ms", type=int, nargs="+", default=[4096])
    parser.add_argument("--transposed", action="store_true", help="weights as transposed views (transformers' GPT-OSS)")
    parser.add_argument("--interleaved", action="store_true", help="gate/up rows alternate (GPT-OSS)")
    parser.add_argument("--bias", action="store_true", help="expert biases (GPT-OSS), their gradients included")
    parser.add_argument("--activation", default="silu", help="the gated activation (GPT-OSS: swigluoai)")
    parser.add_argument("--out", type=Path, default=None, help="append the rows to this CSV")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse --short HEAD)")
    args = parser.parse_args()
    rate = measure_ceilings(False, trials=3).bf16_flops
    print(f"bf16 matmul rate (best of 3 trials): {rate / 1e12:.0f} TFLOP/s", flush=True)
    head = [datetime.datetime.now().isoformat(timespec="seconds"), torch.cuda.get_device_name(), torch.__version__,
            triton.__version__, args.commit or git_commit()]
    for m in args.ms:
        for name in args.shapes:
            rows = run_shape(name, m, rate, args)
            torch.cuda.empty_cache()
            if args.out:
                new = not args.out.exists()
                with args.out.open("a", newline="") as f:
                    writer = csv.writer(f)
                    if new:
                        writer.writerow(FIELDS)
                    writer.writerows(head + row + [f"{rate / 1e12:.0f}"] for row in rows)


if __name__ == "__main__":
    main()
