"""Block fp8: is tmoe's intermediate rounding or vLLM's closer to a float32 pipeline?

tmoe quantizes act(gate) * up to fp8 straight from the up GEMM's float32 accumulators (fused
epilogue); vLLM's up GEMM writes gate and up in bf16, silu_and_mul reads them and writes bf16, and
that is quantized to fp8. Both pipelines here are the pure-PyTorch references (``tmoe.reference``)
on the same fp8 weights and fp8 input: they differ only in that rounding. The float32 pipeline
keeps the intermediate in float32 (no fp8 there). Prints each one's error against it, and how many
outputs differ from each other by more than vLLM's test tolerance (0.035 of the output's max).

    python bench/repro_fp8_block_rounding.py                   # M=83 N=512 K=1024 E=8 topk=2
    python bench/repro_fp8_block_rounding.py --n 4608 --k 7168  # vLLM's test size (needs ~3 GB)
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import tmoe
from tmoe.reference import dequantize_fp8_reference, per_token_group_quant_fp8_reference

BLOCK = (128, 128)


def _fp8_group(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) through per-token-group fp8 (group 128) and back to float32."""
    q, s = per_token_group_quant_fp8_reference(x, BLOCK[1])
    return dequantize_fp8_reference(q, s, (BLOCK[1],))


def layer(x, w1, w2, weights, ids, intermediate: str) -> torch.Tensor:
    """(M, K) float32 output; ``intermediate``: "float32", "tmoe" or "vllm" (see the module docstring)."""
    xq = _fp8_group(x)
    out = torch.zeros(x.shape[0], w2.shape[1])
    n = w2.shape[2]
    for e in range(w1.shape[0]):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = xq[rows] @ w1[e].T  # float32 accumulators [T, 2N]
        gate, up = h[:, :n], h[:, n:]
        if intermediate == "vllm":
            a = (F.silu(gate.bfloat16().float()) * up.bfloat16().float()).bfloat16().float()
        else:
            a = F.silu(gate) * up
        if intermediate != "float32":
            a = _fp8_group(a)
        out.index_add_(0, rows, weights[rows, slots, None] * (a @ w2[e].T))
    return out


def main(m: int, n: int, k: int, e: int, topk: int, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) / 10
    w1 = torch.randn(e, 2 * n, k, generator=g) / k**0.5
    w2 = torch.randn(e, k, n, generator=g) / n**0.5
    (q1, s1), (q2, s2) = (tmoe.quantize_weight_per_block_fp8(w, BLOCK) for w in (w1, w2))
    w1d, w2d = dequantize_fp8_reference(q1, s1, BLOCK), dequantize_fp8_reference(q2, s2, BLOCK)
    weights, ids = torch.topk(torch.randn(m, e, generator=g).softmax(-1), topk)
    outs = {name: layer(x, w1d, w2d, weights, ids, name) for name in ("float32", "tmoe", "vllm")}
    ref = outs["float32"]
    scale = ref.abs().max()
    result = {}
    print(f"M={m} N={n} K={k} E={e} topk={topk} seed={seed}, block {BLOCK}; error against the float32 pipeline:")
    for name in ("tmoe", "vllm"):
        diff = outs[name] - ref
        result[name] = (diff.norm() / ref.norm()).item()
        print(f"  {name:5s} relative L2 {result[name]:.3e}  max |diff| / max|ref| {(diff.abs().max() / scale):.3e}  "
              f"mean |diff| {diff.abs().mean():.3e}")
    apart = ((outs["tmoe"] - outs["vllm"]).abs() > 0.035 * scale).sum().item()
    print(f"  tmoe vs vllm: {apart} of {ref.numel()} outputs differ by more than 0.035 * max|ref|")
    closer = min(result, key=result.get)
    print(f"closer to float32: {closer} (vLLM's relative error is {result['vllm'] / result['tmoe']:.4f}x tmoe's)")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("m", 83), ("n", 512), ("k", 1024), ("e", 8), ("topk", 2), ("seed", 0)):
        parser.add_argument(f"--{name}", type=int, default=default)
    main(**vars(parser.parse_args()))
