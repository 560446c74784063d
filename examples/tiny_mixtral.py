"""A small random Mixtral generating tokens with the stock transformers MoE block and with tmoe,
side by side: greedy tokens compared, time per generated token, and the MoE block alone at
decode size (one token) eager and, for tmoe, replayed as a CUDA graph (the stock block's
``nonzero`` loop cannot be captured).

    python examples/tiny_mixtral.py            # GPU: hidden 1024, 8 experts, 4 layers
    python examples/tiny_mixtral.py --tiny     # CPU-sized (Triton interpreter)
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

import tmoe  # noqa: F401  (sets up the interpreter on CPU)
from tmoe.integrations.transformers import replace_moe_blocks
from tmoe.testing import capture_cuda_graph


def _ms(fn, reps: int) -> float:
    """Median wall time of fn() in ms, synchronizing the GPU around each call."""
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main(tiny: bool = False, new_tokens: int = 32) -> dict[str, float]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if tiny:
        size = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128)
    else:
        size = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=16,
                    num_key_value_heads=4, vocab_size=4096)
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**size, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
    stock = transformers.AutoModelForCausalLM.from_config(config).to(device, torch.bfloat16).eval()
    with torch.no_grad():
        for m in stock.modules():
            if type(m).__name__ == "MixtralExperts":
                m.gate_up_proj.normal_(0, size["hidden_size"] ** -0.5)
                m.down_proj.normal_(0, size["intermediate_size"] ** -0.5)
    fast = copy.deepcopy(stock)
    replace_moe_blocks(fast)
    prompt = torch.randint(0, size["vocab_size"], (1, 16), device=device)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    results, tokens = {}, {}
    reps = 3 if device == "cuda" else 1
    with torch.no_grad():
        for name, model in (("stock", stock), ("tmoe", fast)):
            tokens[name] = model.generate(prompt, **gen)
            results[f"{name} generate ms/token"] = _ms(lambda: model.generate(prompt, **gen), reps) / new_tokens
        same = (tokens["stock"] == tokens["tmoe"]).float().mean().item()
        results["greedy tokens equal (fraction)"] = same
        x = torch.randn(1, 1, size["hidden_size"], device=device, dtype=torch.bfloat16)
        stock_block, fast_block = stock.model.layers[0].mlp, fast.model.layers[0].mlp
        results["stock MoE block, 1 token, eager ms"] = _ms(lambda: stock_block(x), 20 if device == "cuda" else 1)
        results["tmoe MoE block, 1 token, eager ms"] = _ms(lambda: fast_block(x), 20 if device == "cuda" else 1)
        if device == "cuda":
            results["tmoe MoE block, 1 token, CUDA graph ms"] = _ms(capture_cuda_graph(lambda: fast_block(x))[0].replay, 50)
    for key, value in results.items():
        print(f"{key:45s} {value:10.4f}", flush=True)
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    main(args.tiny, args.new_tokens)
