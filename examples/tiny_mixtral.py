"""A small random Mixtral generating tokens with the stock transformers MoE block and with tmoe,
side by side: greedy tokens compared, time per generated token with ``generate`` (DynamicCache)
and with a StaticCache decode loop, eager and, for tmoe on CUDA, the one-token step of the whole
model replayed from one CUDA graph; then the MoE block alone at decode size (one token).

The stock block runs transformers' experts implementation (``grouped_mm`` by default in 5.x,
routing kept on the device). Its ``eager`` implementation loops over the experts that
``nonzero`` finds on the host and cannot be captured in a CUDA graph; ``--stock-experts eager``
times that one, and ``--stock-graph`` also captures the stock model and block (not ``eager``).

    python examples/tiny_mixtral.py            # GPU: hidden 1024, 8 experts, 4 layers
    python examples/tiny_mixtral.py --tiny     # CPU-sized (Triton interpreter)
"""
from __future__ import annotations

import argparse
import copy
import inspect
import os
import time
from typing import Callable

import torch
import transformers

import tmoe  # noqa: F401  (sets up the interpreter on CPU)
from tmoe.integrations.transformers import replace_moe_blocks
from tmoe.testing import capture_cuda_graph


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ms(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of fn() in ms, synchronizing the GPU around each call."""
    fn()
    times = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _forward_kwargs(model: torch.nn.Module, cache: transformers.Cache, positions: torch.Tensor) -> dict:
    """Keyword arguments of a cached forward at ``positions`` (1, q), under the names this
    transformers version takes: ``cache`` (newer) or ``past_key_values``, and ``cache_position``
    (q,) where the forward still has it (newer StaticCache layers count written tokens on the device)."""
    params = inspect.signature(model.forward).parameters
    kwargs = {"cache" if "cache" in params else "past_key_values": cache, "position_ids": positions,
              "use_cache": True}
    if "cache_position" in params:
        kwargs["cache_position"] = positions[0]
    return kwargs


@torch.no_grad()
def decode_static(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int,
                  graph: bool = False) -> tuple[torch.Tensor, float]:
    """Greedy decoding with a transformers StaticCache: an eager prefill gives the first token,
    then each further token is one whole-model forward of one token, run eagerly or (``graph``,
    CUDA only) replayed from a CUDA graph captured once, after the next id and position are
    copied into its static input buffers.

    Args: prompt (1, P) int64 token ids; new_tokens >= 2.
    Returns: tokens (1, P + new_tokens) as ``generate`` returns them, and ms per decode step
    (prefill and capture excluded).
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (prefill makes the first one), got {new_tokens}")
    p = prompt.shape[1]
    cache = transformers.StaticCache(config=model.config, max_cache_len=p + new_tokens)
    prefill_kwargs = _forward_kwargs(model, cache, torch.arange(p, device=prompt.device)[None])
    input_id = prompt.new_zeros(1, 1)  # static inputs of the decode step
    position = prompt.new_zeros(1, 1)
    step_kwargs = _forward_kwargs(model, cache, position)

    def prefill() -> torch.Tensor:
        cache.reset()  # zeroes keys, values and counters in place: graph addresses stay valid
        return model(prompt, **prefill_kwargs).logits[:, -1].argmax(-1, keepdim=True)

    def step() -> torch.Tensor:
        return model(input_id, **step_kwargs).logits[:, -1].argmax(-1, keepdim=True)

    token = prefill()
    if graph:
        input_id.copy_(token)
        position.fill_(p)
        cuda_graph, graph_token = capture_cuda_graph(step)
        token = prefill()  # the capture's warm-up call wrote position p into the cache: start over
    out = [prompt, token]
    _sync()
    t0 = time.perf_counter()
    for i in range(new_tokens - 1):
        input_id.copy_(token)
        position.fill_(p + i)
        if graph:
            cuda_graph.replay()
            token = graph_token.clone()
        else:
            token = step()
        out.append(token)
    _sync()
    return torch.cat(out, dim=1), (time.perf_counter() - t0) * 1e3 / (new_tokens - 1)


def _same(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> float:
    """Fraction of generated (not prompt) tokens equal in a and b, both (1, P + new)."""
    return (a[:, prompt_len:] == b[:, prompt_len:]).float().mean().item()


def main(tiny: bool = False, new_tokens: int = 32, stock_graph: bool = False,
         stock_experts: str | None = None) -> dict[str, float]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if tiny:
        size = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128)
    else:
        size = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=16,
                    num_key_value_heads=4, vocab_size=4096)
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**size, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
    make = {} if stock_experts is None else {"experts_implementation": stock_experts}
    stock = transformers.AutoModelForCausalLM.from_config(config, **make).to(device, torch.bfloat16).eval()
    experts = getattr(stock.config, "_experts_implementation", None) or "eager"
    if stock_graph and experts == "eager":
        raise ValueError("the stock 'eager' experts loop syncs with the host and cannot be captured")
    with torch.no_grad():
        for m in stock.modules():
            if type(m).__name__ == "MixtralExperts":
                m.gate_up_proj.normal_(0, size["hidden_size"] ** -0.5)
                m.down_proj.normal_(0, size["intermediate_size"] ** -0.5)
    fast = copy.deepcopy(stock)
    replace_moe_blocks(fast)
    p = 16
    prompt = torch.randint(0, size["vocab_size"], (1, p), device=device)
    gen = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
               do_sample=False, pad_token_id=0)  # without the mask, generate reads prompt ids 0 as padding
    print(f"stock experts implementation: {experts}", flush=True)
    if device == "cpu" and not tiny:
        print("no CUDA device: this GPU-sized model runs under the Triton interpreter and takes many minutes "
              "(--tiny runs a CPU-sized one); each result prints as it is measured", flush=True)
    results, tokens = {}, {}

    def record(key: str, value: float) -> None:
        results[key] = value
        print(f"{key:55s} {value:10.4f}", flush=True)

    reps = 3 if device == "cuda" else 1
    with torch.no_grad():
        for name, model in (("stock", stock), ("tmoe", fast)):
            tokens[name] = model.generate(prompt, **gen)
            record(f"{name} generate ms/token (DynamicCache)", _ms(lambda: model.generate(prompt, **gen),
                                                                   reps) / new_tokens)
        graphs = {"stock": device == "cuda" and stock_graph, "tmoe": device == "cuda"}
        for name, model in (("stock", stock), ("tmoe", fast)):
            for graph in (False, True) if graphs[name] else (False,):
                if device == "cuda":
                    decode_static(model, prompt, new_tokens, graph)  # warm-up: JIT, cuBLAS handles
                tokens[name, graph], ms = decode_static(model, prompt, new_tokens, graph)
                mode = "CUDA graph" if graph else "eager"
                record(f"{name} StaticCache {mode} ms/token (decode steps)", ms)
        record("greedy tokens equal, stock vs tmoe generate", _same(tokens["stock"], tokens["tmoe"], p))
        record("greedy tokens equal, stock vs tmoe StaticCache", _same(tokens["stock", False], tokens["tmoe", False], p))
        record("greedy tokens equal, tmoe StaticCache vs generate", _same(tokens["tmoe", False], tokens["tmoe"], p))
        for name in ("stock", "tmoe"):
            if graphs[name]:
                record(f"greedy tokens equal, {name} CUDA graph vs eager", _same(tokens[name, True],
                                                                                 tokens[name, False], p))
        x = torch.randn(1, 1, size["hidden_size"], device=device, dtype=torch.bfloat16)
        stock_block, fast_block = stock.model.layers[0].mlp, fast.model.layers[0].mlp
        block_reps = 20 if device == "cuda" else 1
        record(f"stock MoE block ({experts}), 1 token, eager ms", _ms(lambda: stock_block(x), block_reps))
        record("tmoe MoE block, 1 token, eager ms", _ms(lambda: fast_block(x), block_reps))
        if graphs["stock"]:
            record(f"stock MoE block ({experts}), 1 token, CUDA graph ms",
                   _ms(capture_cuda_graph(lambda: stock_block(x))[0].replay, 50))
        if device == "cuda":
            record("tmoe MoE block, 1 token, CUDA graph ms", _ms(capture_cuda_graph(lambda: fast_block(x))[0].replay, 50))
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--stock-graph", action="store_true", help="also capture the stock model and block (CUDA)")
    ap.add_argument("--stock-experts", choices=["eager", "grouped_mm", "batched_mm"], default=None,
                    help="transformers experts implementation of the stock model (default: transformers' choice)")
    args = ap.parse_args()
    main(args.tiny, args.new_tokens, args.stock_graph, args.stock_experts)
