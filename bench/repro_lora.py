"""What does a LoRA adapter on the experts cost, fused (``w1_lora_a`` ... on ``tmoe.fused_experts``)
against the layer without one and against PEFT's way (the adapted weight w + s * b @ a formed on
every forward, then the same layer; its backward runs the full weight-gradient GEMMs)? And, with
``--serving``, what do several adapters served at once cost (stacked factors and ``lora_ids``)
against the layer without them and against vLLM's MoE-LoRA kernels?

bf16, rank 16 on w1 and w2, frozen base, at the Qwen3-30B-A3B and Mixtral-8x7B sizes. ``forward``:
the inference forward, ``do_bench_cudagraph`` median; ``train``: forward and backward of x, the
router weights and the factors, ``do_bench`` median, with the step's peak memory above the inputs.

``--serving`` (mode ``serve_l8``): 8 adapters, every token with one drawn at random, graph replay.
Providers ``tmoe`` (no adapters), ``tmoe+lora`` (the stacked adapters), ``vllm-lora-kernels``
(vLLM's MoE-LoRA add-on alone: ``fused_moe_lora_op``'s shrink and expand for w13, one slice of 2N
outputs, and for w2 with the router weight; its default configs, its zero-filled caches and the
adds into the GEMM outputs; on the same routing and adapters, its (lora, expert) align made by
tmoe's align on virtual experts, vLLM's being a CUDA op) and ``tmoe+vllm-lora`` (``tmoe`` plus the
add-on: vLLM's path with tmoe's base layer, which ties vLLM's base Triton layer on the H100 at
these sizes: bench_moe.csv). The vLLM providers run where
``vllm.lora.ops.triton_ops.fused_moe_lora_op`` imports (vLLM installed, or its source on
PYTHONPATH); otherwise they are left out and the script says so.

GPU only: ``python bench/repro_lora.py [--serving] [--out CSV] [--ms ...]`` (``--out`` appends one
row per case, mode and provider: FIELDS)."""
from __future__ import annotations

import argparse
import datetime
import importlib
from pathlib import Path
from typing import Callable

import torch
import triton

import tmoe
from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.lora_slots import lora_slots
from tmoe.tools.results import append_lines, git_commit

CASES = {"qwen3": (128, 768, 2048, 8), "mixtral": (8, 14336, 4096, 2)}  # E, N, K, topk
FIELDS = ["date", "gpu", "torch", "triton", "commit", "shape", "M", "rank", "mode", "provider", "us", "peak_mib"]
RANK, SCALE = 16, 2.0
ADAPTERS, VLLM_BLOCK_M = 8, 64  # served at once; vLLM's default MoE-LoRA tiles are 64 rows high


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


def vllm_lora_module():
    """vLLM's MoE-LoRA Triton op module, or None where vLLM does not import."""
    try:
        return importlib.import_module("vllm.lora.ops.triton_ops.fused_moe_lora_op")
    except ImportError:
        return None


def vllm_lora_addon(op, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    lora_ids: torch.Tensor, adapters: dict, n: int) -> tuple[Callable[[], None], Callable[[], float]]:
    """vLLM's MoE-LoRA kernels as its layer runs them around the base GEMMs: w13's shrink and expand
    added into the up GEMM's (M, topk, 2N) output, w2's (router weight applied) into the down
    GEMM's (M, topk, K) output; the intermediate is a stand-in of the right shape. Returns the call
    and a check (the largest error of one call against torch, so a peer that skipped its work shows)."""
    m, topk = topk_ids.shape
    num_adapters, e, _, k = adapters["w1_lora_a"].shape
    vids, _ = lora_slots(topk_ids, lora_ids, num_adapters, e)
    sorted_ids, vexp, ntpp = moe_align_block_size(vids, VLLM_BLOCK_M, num_adapters * e)
    l = torch.arange(num_adapters, device=x.device)[:, None]
    expert_ids = torch.where(vexp[None, :] // e == l, vexp[None, :] % e, -1).to(torch.int32)  # (L, blocks)
    sorted_ids = sorted_ids[None, :].expand(num_adapters, -1).contiguous()
    ntpp = ntpp.expand(num_adapters).contiguous()
    active = torch.arange(num_adapters, dtype=torch.int32, device=x.device)
    enabled = torch.ones(num_adapters + 1, dtype=torch.int32, device=x.device)
    out13 = torch.zeros(m, topk, 2 * n, dtype=x.dtype, device=x.device)
    out2 = torch.zeros(m, topk, k, dtype=x.dtype, device=x.device)
    inter = torch.randn(m * topk, n, dtype=x.dtype, device=x.device)
    shrink = dict(block_size_m=VLLM_BLOCK_M, block_size_n=min(64, RANK), block_size_k=32, group_size_m=8, num_warps=4,
                  num_stages=3, split_k=1)
    expand = dict(block_size_m=VLLM_BLOCK_M, block_size_n=64, block_size_k=max(16, min(32, RANK)), group_size_m=8,
                  num_warps=4, num_stages=3, split_k=1)
    em = sorted_ids.shape[1]

    def one(out, rows, a, b, top_k, routed):
        mm = out.shape[0]
        cache = torch.zeros(1, mm, top_k, RANK, dtype=x.dtype, device=x.device)
        op._fused_moe_lora_shrink(cache, rows, [a], topk_weights, sorted_ids, expert_ids, ntpp, top_k, active, enabled,
                                  x.device, RANK, mm, em, rows.shape[1], mm * top_k, e, 1, **shrink,
                                  num_active_loras=num_adapters)
        op._fused_moe_lora_expand(out, cache, [b], topk_weights, sorted_ids, expert_ids, ntpp, top_k, active, enabled,
                                  x.device, RANK, mm, em, rows.shape[1], mm * top_k, e, 1, RANK, b.shape[2], **expand,
                                  num_active_loras=num_adapters, mul_routed_weight=routed)

    def run() -> None:
        one(out13, x, adapters["w1_lora_a"], adapters["w1_lora_b"], topk, False)
        one(out2.view(m * topk, 1, k), inter, adapters["w2_lora_a"], adapters["w2_lora_b"], 1, True)

    def check() -> float:
        """Run once into zeroed outputs; the largest error against float32 torch of the same terms."""
        out13.zero_()
        out2.zero_()
        run()
        a1, b1, a2, b2 = (adapters[f].float() for f in ("w1_lora_a", "w1_lora_b", "w2_lora_a", "w2_lora_b"))
        lid = lora_ids.long()[:, None].expand(m, topk)
        t1 = torch.einsum("mk,mtrk->mtr", x.float(), a1[lid, topk_ids.long()])
        ref13 = torch.einsum("mtr,mtor->mto", t1, b1[lid, topk_ids.long()])
        t2 = torch.einsum("mtn,mtrn->mtr", inter.float().view(m, topk, n), a2[lid, topk_ids.long()])
        ref2 = torch.einsum("mtr,mtor->mto", t2, b2[lid, topk_ids.long()]) * topk_weights[..., None]
        return max((out13.float() - ref13).abs().max().item(), (out2.float() - ref2).abs().max().item())
    return run, check


def adapter_rows(args: argparse.Namespace, env: list, rows: list) -> None:
    """One adapter: the forward and the train step of tmoe, tmoe+lora and tmoe+merged."""
    dev, bf16 = "cuda", torch.bfloat16
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


def serving_rows(args: argparse.Namespace, env: list, rows: list) -> None:
    """Several adapters served at once (``--serving``): tmoe, tmoe+lora and vLLM's add-on."""
    dev, bf16 = "cuda", torch.bfloat16
    op = vllm_lora_module()
    if op is None:
        print("vLLM's fused_moe_lora_op does not import: the vLLM providers are left out")
    for shape in args.shapes.split(","):
        e, n, k, topk = CASES[shape]
        w1 = torch.randn(e, 2 * n, k, device=dev, dtype=bf16) / k**0.5
        w2 = torch.randn(e, k, n, device=dev, dtype=bf16) / n**0.5
        adapters = {"w1_lora_a": torch.randn(ADAPTERS, e, RANK, k, device=dev) / k**0.5,
                    "w1_lora_b": torch.randn(ADAPTERS, e, 2 * n, RANK, device=dev) / 100,
                    "w2_lora_a": torch.randn(ADAPTERS, e, RANK, n, device=dev) / n**0.5,
                    "w2_lora_b": torch.randn(ADAPTERS, e, k, RANK, device=dev) / 100}
        adapters = {name: t.to(bf16) for name, t in adapters.items()}
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=bf16)
            w, ids = torch.topk(torch.softmax(torch.randn(m, e, device=dev), -1), topk)
            ids = ids.int()
            lora_ids = torch.randint(0, ADAPTERS, (m,), device=dev, dtype=torch.int32)
            calls = {"tmoe": lambda: tmoe.fused_experts(x, w1, w2, w, ids),
                     "tmoe+lora": lambda: tmoe.fused_experts(x, w1, w2, w, ids, lora_ids=lora_ids, **adapters)}
            if op is not None:
                calls["vllm-lora-kernels"], check = vllm_lora_addon(op, x, w, ids, lora_ids, adapters, n)
                with torch.no_grad():
                    if (err := check()) > 0.05:
                        raise RuntimeError(f"vLLM's MoE-LoRA terms differ from torch's by {err:.3g} at {shape} M={m}")
            with torch.no_grad():
                us = {name: triton.testing.do_bench_cudagraph(fn) * 1e3 for name, fn in calls.items()}
            if op is not None:
                us["tmoe+vllm-lora"] = us["tmoe"] + us["vllm-lora-kernels"]
            for name, t in us.items():
                rows.append([*env, shape, m, RANK, f"serve_l{ADAPTERS}", name, f"{t:.1f}", ""])
            print(shape, m, " ".join(f"{name}={t:.1f}" for name, t in us.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python bench/repro_lora.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="append the rows to this CSV")
    parser.add_argument("--serving", action="store_true", help=f"{ADAPTERS} adapters served at once, against vLLM's")
    parser.add_argument("--ms", default=None, help="token counts (default 1,64,1024,4096; --serving: 1,16,64,256)")
    parser.add_argument("--shapes", default="qwen3,mixtral")
    args = parser.parse_args()
    args.ms = args.ms or ("1,16,64,256" if args.serving else "1,64,1024,4096")
    torch.manual_seed(0)
    env = [datetime.datetime.now().isoformat(timespec="seconds"), torch.cuda.get_device_name(), torch.__version__,
           triton.__version__, git_commit()]
    rows = []
    (serving_rows if args.serving else adapter_rows)(args, env, rows)
    if args.out:
        append_lines(args.out, FIELDS, rows)


if __name__ == "__main__":
    main()
