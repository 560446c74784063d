"""What does a LoRA adapter on the experts cost, fused (``w1_lora_a`` ... on ``tmoe.fused_experts``)
against the layer without one and against PEFT's way (the adapted weight w + s * b @ a formed on
every forward, then the same layer; its backward runs the full weight-gradient GEMMs)?

bf16, rank 16 on w1 and w2, frozen base, at the Qwen3-30B-A3B and Mixtral-8x7B sizes. ``forward``:
the inference forward, ``do_bench_cudagraph`` median; ``train``: forward and backward of x, the
router weights and the factors, ``do_bench`` median, with the step's peak memory above the inputs.
GPU only: ``python bench/repro_lora.py [--out CSV] [--ms 1,64,1024,4096]`` (``--out`` appends one
row per case, mode and provider: FIELDS)."""
from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
import triton

import tmoe
from tmoe.tools.results import append_lines, git_commit

CASES = {"qwen3": (128, 768, 2048, 8), "mixtral": (8, 14336, 4096, 2)}  # E, N, K, topk
FIELDS = ["date", "gpu", "torch", "triton", "commit", "shape", "M", "rank", "mode", "provider", "us", "peak_mib"]
RANK, SCALE = 16, 2.0


def _layer(provider: str, w1, w2, adapters: dict):
    """The layer call of a provider: (x, topk_weights, topk_ids) -> out."""
    if provider == "tmoe":
        return lambda x, w, ids: tmoe.fused_experts(x, w1, w2, w, ids)
    if provider == "tmoe+lora":
        return lambda x, w, ids: tmoe.fused_experts(x, w1, w2, w, ids, lora_scale=SCALE, **adapters)

    def merged(x, w, ids):  # PEFT's target_parameters: the delta added to the weight on every forward
        m1 = torch.baddbmm(w1, adapters["w1_lora_b"], adapters["w1_lora_a"], alpha=SCALE)
        m2 = torch.baddbmm(w2, adapters["w2_lora_b"], adapters["w2_lora_a"], alpha=SCALE)
        return tmoe.fused_experts(x, m1, m2, w, ids)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(prog="python bench/repro_lora.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="append the rows to this CSV")
    parser.add_argument("--ms", default="1,64,1024,4096")
    parser.add_argument("--shapes", default="qwen3,mixtral")
    args = parser.parse_args()
    torch.manual_seed(0)
    env = [datetime.datetime.now().isoformat(timespec="seconds"), torch.cuda.get_device_name(), torch.__version__,
           triton.__version__, git_commit()]
    dev, bf16 = "cuda", torch.bfloat16
    rows = []
    for shape in args.shapes.split(","):
        e, n, k, topk = CASES[shape]
        w1 = torch.randn(e, 2 * n, k, device=dev, dtype=bf16) / k**0.5
        w2 = torch.randn(e, k, n, device=dev, dtype=bf16) / n**0.5
        adapters = {"w1_lora_a": torch.randn(e, RANK, k) / k**0.5, "w1_lora_b": torch.randn(e, 2 * n, RANK) / 100,
                    "w2_lora_a": torch.randn(e, RANK, n) / n**0.5, "w2_lora_b": torch.randn(e, k, RANK) / 100}
        adapters = {name: t.to(dev, bf16).requires_grad_() for name, t in adapters.items()}
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=bf16)
            w, ids = torch.topk(torch.softmax(torch.randn(m, e, device=dev), -1), topk)
            ids = ids.int()
            for provider in ("tmoe", "tmoe+lora", "tmoe+merged"):
                layer = _layer(provider, w1, w2, adapters)
                with torch.no_grad():
                    us = triton.testing.do_bench_cudagraph(lambda: layer(x, w, ids)) * 1e3
                rows.append([*env, shape, m, RANK, "forward", provider, f"{us:.1f}", ""])
                xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                grad_out = torch.randn_like(x)
                inputs = [xg, wg] + (list(adapters.values()) if provider != "tmoe" else [])

                def step():
                    torch.autograd.grad(layer(xg, wg, ids), inputs, grad_out)

                step()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                us = triton.testing.do_bench(step) * 1e3
                rows.append([*env, shape, m, RANK, "train", provider, f"{us:.1f}", f"{peak:.0f}"])
                print(",".join(map(str, rows[-2][5:])), "|", ",".join(map(str, rows[-1][5:])), flush=True)
    if args.out:
        append_lines(args.out, FIELDS, rows)


if __name__ == "__main__":
    main()
