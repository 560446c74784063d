"""``python -m tmoe bench-hf``: transformers' experts implementations compared (GPU; ``--tiny`` runs on CPU).

Training: one decoder layer at Qwen3-30B-A3B's and GPT-OSS-20B's sizes (bf16, ``--tokens`` rows),
forward + backward + AdamW step, median ms and peak memory, for each ``experts_implementation``;
``--lora R``: PEFT's LoRA of rank R on the experts (``target_parameters``, the base frozen, AdamW on
the factors), rows ``train_layer_lora_r<R>``.
Inference: ``generate`` with a static cache under torch.compile, ms per new token, for a 2-layer
model at Qwen3-30B-A3B's sizes ("tmoe" with CUDA graphs; "grouped_mm", which cannot be captured,
with max-autotune-no-cudagraphs). Each row is printed as it is measured; ``--csv PATH`` also appends it
to PATH, keyed by GPU, versions and commit (a developer recording a run passes ``bench/results/bench_hf.csv``).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import statistics
import time
from pathlib import Path

import torch
import transformers
import triton

import tmoe.integrations.transformers  # noqa: F401  (registers "tmoe")
from tmoe.tools.results import git_commit

QWEN3_30B = dict(config="Qwen3MoeConfig", hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                 num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936)
GPT_OSS_20B = dict(config="GptOssConfig", hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                   num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                   layer_types=["full_attention"])
TINY = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=32, num_experts=4, num_local_experts=4,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96)
TRAIN_MODELS = {"qwen3_30b_a3b": QWEN3_30B, "gpt_oss_20b": GPT_OSS_20B}
IMPLEMENTATIONS = ["tmoe", "grouped_mm", "eager"]
FIELDS = ["date", "gpu", "torch", "triton", "transformers", "commit", "bench", "model", "implementation", "batch",
          "tokens", "ms", "peak_gib"]


def _config(sizes: dict, layers: int, tiny: bool) -> transformers.PretrainedConfig:
    sizes = dict(sizes)
    cls = getattr(transformers, sizes.pop("config"))
    if tiny:
        sizes |= {k: v for k, v in TINY.items() if k in sizes}
    return cls(**sizes, num_hidden_layers=layers, max_position_embeddings=4096)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


LORA_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def peft_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` with PEFT's LoRA of rank ``rank`` (alpha 2 * rank) on its experts' weights
    (``target_parameters``), everything else frozen: the recipe of docs/huggingface.md."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[], target_parameters=LORA_TARGETS)
    return peft.get_peft_model(model, config).base_model.model


def train_layer(sizes: dict, implementation: str, tokens: int, batch: int, tiny: bool, device: str,
                lora_rank: int | None = None) -> tuple[float, float]:
    """(median ms, peak GiB) of one forward + backward + AdamW step of the model's first decoder
    layer (``lora_rank``: of its PEFT LoRA factors on the experts, the rest frozen)."""
    config = _config(sizes, 1, tiny)
    dtype = torch.float32 if tiny else torch.bfloat16
    with torch.device(device):  # built where it runs (a CPU init of GPT-OSS's 201k-row embeddings takes minutes)
        model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=implementation,
                                                              dtype=dtype)
    if lora_rank is not None:
        model = peft_lora(model, lora_rank)
    layer, rotary = model.model.layers[0].train(), model.model.rotary_emb
    del model  # the embeddings and head are freed before the peak is reset
    x = torch.randn(batch, tokens, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(tokens, device=device).expand(batch, -1)
    embeddings = rotary(x, positions)
    optimizer = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=1e-5)

    def step():
        out = layer(x, position_embeddings=embeddings, position_ids=positions)
        (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    ms = _median_ms(step, 3 if tiny else 10)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return ms, peak


def generate_ms(implementation: str, batch: int, new_tokens: int, tiny: bool, device: str) -> float:
    """ms per new token of greedy ``generate`` (static cache, compiled) on a 2-layer Qwen3-30B-A3B-sized model.

    With a static cache, ``generate`` compiles the decode steps itself from ``compile_config``
    (the prefill runs eager); wrapping ``model.forward`` in another ``torch.compile`` would nest two.
    """
    dtype = torch.float32 if tiny else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_config(_config(QWEN3_30B, 2, tiny), dtype=dtype,
                                                          experts_implementation=implementation).to(device).eval()
    with torch.no_grad():  # one eager call decides each experts module's layout (see docs/huggingface.md)
        model(torch.zeros(1, 1, dtype=torch.long, device=device))
    cuda = torch.cuda.is_available()
    mode = "reduce-overhead" if cuda and implementation != "grouped_mm" else "max-autotune-no-cudagraphs"
    compile_config = transformers.CompileConfig(fullgraph=implementation == "tmoe", mode=mode if cuda else "default")
    compile_config._compile_all_devices = not cuda  # transformers compiles only on accelerators unless told
    prompt = torch.randint(0, model.config.vocab_size, (batch, 16), device=device)

    def run():
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           cache_implementation="static", compile_config=compile_config)

    return _median_ms(run, 1 if tiny else 3) / new_tokens


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tmoe bench-hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke run of the script)")
    p.add_argument("--tokens", type=int, default=None, help="rows per sequence of the training step (4096; 16 with --tiny)")
    p.add_argument("--batch", type=int, default=None, help="sequences of the training step (4; 2 with --tiny)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generate adds (64; 4 with --tiny)")
    p.add_argument("--skip", choices=["train", "generate"], default=None)
    p.add_argument("--models", nargs="+", choices=list(TRAIN_MODELS), default=list(TRAIN_MODELS),
                   help="the training rows' models (default: both)")
    p.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=IMPLEMENTATIONS,
                   help="the training rows' experts implementations (generate compares tmoe and grouped_mm)")
    p.add_argument("--lora", type=int, default=None, metavar="R",
                   help="train PEFT LoRA factors of rank R on the experts instead of the whole layer")
    p.add_argument("--csv", type=Path, default=None, metavar="PATH",
                   help="append each row to this CSV as measured (default: none, the rows are printed; a developer "
                        "recording a run passes bench/results/bench_hf.csv)")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse --short HEAD)")
    args = p.parse_args(argv)
    if args.lora is not None and not 1 <= args.lora <= 128:
        p.error(f"--lora must be a rank in 1..128, got {args.lora}")
    if args.lora is not None and importlib.util.find_spec("peft") is None:
        p.error("--lora needs PEFT (pip install -e \".[hf]\")")
    defaults = (16, 2, 4) if args.tiny else (4096, 4, 64)
    args.tokens, args.batch, args.new_tokens = (given if given is not None else default for given, default in
                                                zip((args.tokens, args.batch, args.new_tokens), defaults))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    head = [datetime.datetime.now().isoformat(timespec="seconds"), gpu, torch.__version__, triton.__version__,
            transformers.__version__, args.commit or git_commit()]
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)

    def record(row: list) -> None:  # each row as it is measured: a run cut short keeps what it measured
        print(*row, flush=True)
        if not args.csv:
            return
        new = not args.csv.exists()
        with args.csv.open("a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(FIELDS)
            w.writerow(head + row)

    if args.skip != "train":
        for name in args.models:
            for impl in args.implementations:
                ms, peak = train_layer(TRAIN_MODELS[name], impl, args.tokens, args.batch, args.tiny, device, args.lora)
                bench = "train_layer" if args.lora is None else f"train_layer_lora_r{args.lora}"
                record([bench, name, impl, args.batch, args.tokens, f"{ms:.2f}", f"{peak:.2f}"])
    if args.skip != "generate":
        for batch in (1, 32):
            for impl in ("tmoe", "grouped_mm"):
                ms = generate_ms(impl, batch, args.new_tokens, args.tiny, device)
                record(["generate_ms_per_token", "qwen3_30b_a3b_2layer", impl, batch, args.new_tokens, f"{ms:.3f}", ""])
    return 0
