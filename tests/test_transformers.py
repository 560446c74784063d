"""Drop-in use in tiny random Hugging Face MoE models (config objects only, no downloads)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tmoe.integrations.transformers import TmoeExperts, replace_moe_blocks  # noqa: E402
from tmoe.testing import assert_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def _configs():
    t = transformers
    return {
        "mixtral": lambda: t.MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=48,
                                              shared_expert_intermediate_size=64, num_experts=6,
                                              num_experts_per_tok=2),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=48,
                                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        "deepseek_v3": lambda: t.DeepseekV3Config(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                                                  n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                                  n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                                                  kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                  v_head_dim=16, routed_scaling_factor=2.5),
        "gpt_oss": lambda: t.GptOssConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                          head_dim=16, layer_types=["full_attention"] * 2),
    }


def _model(name, dtype=torch.float32):
    torch.manual_seed(0)
    config = _configs()[name]()
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, dtype).eval()
    with torch.no_grad():  # random, non-trivial expert and router-bias weights
        for module in model.modules():
            if type(module).__name__.endswith("Experts"):
                for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                    if hasattr(module, name):
                        getattr(module, name).normal_(0, 0.08)
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_logits_match_after_swap(name, dtype=torch.float32):
    model = _model(name, dtype)
    tokens = torch.randint(0, 96, (2, 7), device=DEVICE)
    with torch.no_grad():
        before = model(tokens).logits
        assert replace_moe_blocks(model) >= 1
        after = model(tokens).logits
    assert any(isinstance(m, TmoeExperts) for m in model.modules())
    assert_close(after, before, dtype, name=f"{name} logits")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_bf16_experts_match_float32_experts(name):
    """bf16 end-to-end logits are not comparable (a rounding difference can flip a later layer's
    routing), so in bf16 each swapped experts module is checked on its own, on the model's own
    routing, against the stock module run in float32."""
    model = _model(name, torch.bfloat16)
    block = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "router" if name == "gpt_oss"
                                                                                  else "gate"))
    stock = block.experts
    x = torch.randn(14, 64, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        _, weights, ids = (block.router if name == "gpt_oss" else block.gate)(x)
        ref = copy.deepcopy(stock).float()(x.float(), ids, weights.float())
        replace_moe_blocks(model)
        out = block.experts(x, ids, weights)
    assert isinstance(block.experts, TmoeExperts)
    assert_close(out, ref, torch.bfloat16)


def test_swapped_block_compiles_fullgraph():
    model = _model("qwen3_moe")
    replace_moe_blocks(model)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 5, 64, device=DEVICE)
    with torch.no_grad():
        eager = block(x)
        compiled = torch.compile(block, fullgraph=True)(x)
    assert_close(compiled, eager, torch.float32)
