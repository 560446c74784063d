"""``python -m tmoe bench-hf``'s PEFT LoRA training rows (``--lora``): the recipe trains the factors
alone, and a tiny step runs on CPU through tmoe's fused LoRA path."""
import math

import pytest
import torch

pytest.importorskip("peft")
import transformers  # noqa: E402

from tmoe.tools import bench_hf  # noqa: E402
from tmoe.testing import RecordOps  # noqa: E402


def test_lora_recipe_trains_the_expert_factors_alone():
    tiny = transformers.AutoModelForCausalLM.from_config(bench_hf._config(bench_hf.QWEN3_30B, 1, True))
    model = bench_hf.peft_lora(tiny, 4)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n and "experts" in n for n in trainable), trainable


def test_lora_step_runs_fused():
    with RecordOps() as ops:
        ms, _ = bench_hf.train_layer(bench_hf.QWEN3_30B, "tmoe", 8, 1, True, "cpu", lora_rank=4)
    assert math.isfinite(ms) and ms > 0
    assert "tmoe::moe_lora_token_rows" in ops.names, "the PEFT step must take tmoe's fused LoRA path"


def test_lora_rank_is_checked(monkeypatch, capsys):
    assert bench_hf.parse_args(["--lora", "16"]).lora == 16 and bench_hf.parse_args([]).lora is None
    for bad in ("0", "129"):
        with pytest.raises(SystemExit):
            bench_hf.parse_args(["--lora", bad])
    assert "--lora must be a rank in 1..128" in capsys.readouterr().err
    monkeypatch.setattr(bench_hf.importlib.util, "find_spec", lambda name: None)  # PEFT not installed
    with pytest.raises(SystemExit):
        bench_hf.parse_args(["--lora", "16"])
    assert "--lora needs PEFT" in capsys.readouterr().err
