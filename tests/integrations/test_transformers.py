"""Drop-in use in tiny random Hugging Face MoE models (config objects only, no downloads)."""
import copy
import importlib
import inspect
import re
import warnings
from dataclasses import dataclass, field

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tmoe.integrations.transformers import (  # noqa: E402
    SUPPORTED_EXPERTS, TmoeExperts, TmoeLlama4TextMoe, replace_moe_blocks,
)
from tmoe.testing import assert_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 96
# Applied to every config whose constructor takes the field.
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=64,
             n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
           num_key_value_heads=4)  # multi-head latent attention
DSA = MLA | dict(index_topk=4, index_head_dim=16, index_n_heads=2)  # MLA with a sparse-attention indexer
SPARSE = dict(mlp_layer_types=["sparse"])  # no dense first layer
HYBRID = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])  # one of each
GEMMA_MOE = dict(enable_moe_block=True, top_k_experts=2)


@dataclass(frozen=True)
class Family:
    """A tiny model of one family: its config class, the model class built from it (a causal
    LM, or the text model where the family has none) and the fields beyond ``SIZES``."""

    config: str
    model: str
    experts: str
    kwargs: dict = field(default_factory=dict)


FAMILIES = {
    "afmoe": Family("AfmoeConfig", "AfmoeForCausalLM", "AfmoeExperts", dict(num_dense_layers=0)),
    "aria_text": Family("AriaTextConfig", "AriaTextForCausalLM", "AriaExperts", dict(moe_num_experts=4, moe_topk=2)),
    "axk1": Family("AXK1Config", "AXK1ForCausalLM", "AXK1Experts", MLA | SPARSE),
    "axk2": Family("AXK2Config", "AXK2ForCausalLM", "AXK2Experts", DSA | SPARSE),
    "bailing_hybrid": Family("BailingHybridConfig", "BailingHybridForCausalLM", "BailingHybridExperts",
                             HYBRID | MLA | dict(mlp_layer_types=["sparse"] * 2)),
    "beam": Family("BeamConfig", "BeamForCausalLM", "BeamExperts", SPARSE),
    "cohere2_moe": Family("Cohere2MoeConfig", "Cohere2MoeForCausalLM", "Cohere2MoeExperts"),
    "dbrx": Family("DbrxConfig", "DbrxForCausalLM", "DbrxExperts",  # stock DBRX needs rope_theta and clip_qkv set
                   dict(d_model=64, n_heads=4, n_layers=1, max_seq_len=64,
                        attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),
                        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2))),
    "deepseek_v2": Family("DeepseekV2Config", "DeepseekV2ForCausalLM", "DeepseekV2Experts", MLA),
    "deepseek_v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", "DeepseekV3Experts",
                          MLA | dict(n_group=2, routed_scaling_factor=2.5)),
    "deepseek_v32": Family("DeepseekV32Config", "DeepseekV32ForCausalLM", "DeepseekV32Experts", DSA),
    "dots1": Family("Dots1Config", "Dots1ForCausalLM", "Dots1Experts"),
    "dots3_note_text": Family("Dots3NoteTextConfig", "Dots3NoteForCausalLM", "Dots3NoteExperts", DSA | SPARSE),
    "ernie4_5_moe": Family("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeExperts",
                           dict(moe_layer_start_index=0, moe_num_experts=4, moe_k=2)),
    "exaone_moe": Family("ExaoneMoeConfig", "ExaoneMoeForCausalLM", "ExaoneMoeExperts"),
    "flex_olmo": Family("FlexOlmoConfig", "FlexOlmoForCausalLM", "FlexOlmoExperts"),
    "flint": Family("FlintConfig", "FlintForCausalLM", "FlintExperts", dict(mlp_only_layers=[])),
    "gemma4_text": Family("Gemma4TextConfig", "Gemma4ForCausalLM", "Gemma4TextExperts",
                          GEMMA_MOE | dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)),
    "glm4_moe": Family("Glm4MoeConfig", "Glm4MoeForCausalLM", "Glm4MoeExperts"),
    "glm4_moe_lite": Family("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", "Glm4MoeLiteExperts", MLA | SPARSE),
    "glm_moe_dsa": Family("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", "GlmMoeDsaExperts", DSA),
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM", "GptOssExperts",
                      dict(intermediate_size=48, layer_types=["full_attention"])),
    "granitemoe": Family("GraniteMoeConfig", "GraniteMoeForCausalLM", "GraniteMoeExperts"),
    "granitemoe_swa": Family("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", "GraniteMoeSWAExperts"),
    "granitemoehybrid": Family("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", "GraniteMoeHybridExperts",
                               dict(num_hidden_layers=2, layer_types=["mamba", "attention"], mamba_n_heads=4,
                                    mamba_d_state=8, mamba_d_head=32, mamba_chunk_size=8)),
    "granitemoeshared": Family("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", "GraniteMoeSharedExperts"),
    "hunyuan_v1_moe": Family("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Experts"),
    "hy_v3": Family("HYV3Config", "HYV3ForCausalLM", "HYV3Experts", SPARSE),
    "inkling_text": Family("InklingTextConfig", "InklingForCausalLM", "InklingExperts"),
    "jamba": Family("JambaConfig", "JambaForCausalLM", "JambaExperts",
                    dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1,
                         expert_layer_offset=0, use_mamba_kernels=False, mamba_d_state=8)),
    "kimi_linear": Family("KimiLinearConfig", "KimiLinearForCausalLM", "KimiLinearExperts",
                          HYBRID | MLA | dict(mlp_layer_types=["sparse"] * 2)),
    "kolibri1": Family("Kolibri1Config", "Kolibri1ForCausalLM", "Kolibri1Experts"),
    "kolibri1_1": Family("Kolibri1_1Config", "Kolibri1_1ForCausalLM", "Kolibri1_1Experts",
                         dict(index_num_heads=2, mlp_only_layers=[])),
    "laguna": Family("LagunaConfig", "LagunaForCausalLM", "LagunaExperts", SPARSE),
    "lara_mini": Family("LaraMiniConfig", "LaraMiniForCausalLM", "LaraMiniExperts"),
    "lfm2_moe": Family("Lfm2MoeConfig", "Lfm2MoeForCausalLM", "Lfm2MoeExperts",
                       dict(num_hidden_layers=2, num_dense_layers=0, layer_types=["conv", "full_attention"])),
    "llama4_text": Family("Llama4TextConfig", "Llama4ForCausalLM", "Llama4TextExperts"),
    "llama4_text_top1": Family("Llama4TextConfig", "Llama4ForCausalLM", "Llama4TextExperts",
                               dict(num_experts_per_tok=1)),  # as Llama 4 Scout and Maverick route
    "longcat_flash": Family("LongcatFlashConfig", "LongcatFlashForCausalLM", "LongcatFlashExperts",
                            MLA | dict(num_layers=1, ffn_hidden_size=64, expert_ffn_hidden_size=32, moe_topk=2,
                                       zero_expert_num=2)),
    "mellum": Family("MellumConfig", "MellumForCausalLM", "MellumExperts"),
    "mimo_v2_flash": Family("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", "MiMoV2FlashExperts", SPARSE),
    "minicpm5_moe": Family("MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM", "MiniCPM5MoeExperts", SPARSE),
    "minimax": Family("MiniMaxConfig", "MiniMaxForCausalLM", "MiniMaxExperts"),
    "minimax_m2": Family("MiniMaxM2Config", "MiniMaxM2ForCausalLM", "MiniMaxM2Experts"),
    "minimax_m3_vl_text": Family("MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM", "MiniMaxM3VLExperts"),
    "mistral4": Family("Mistral4Config", "Mistral4ForCausalLM", "Mistral4Experts", MLA | dict(head_dim=16)),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", "MixtralExperts"),
    "mixtral_gelu": Family("MixtralConfig", "MixtralForCausalLM", "MixtralExperts", dict(hidden_act="gelu")),
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM", "OlmoeExperts"),
    "phimoe": Family("PhimoeConfig", "PhimoeForCausalLM", "PhimoeExperts"),
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen2MoeExperts"),
    "qwen3_5_moe_text": Family("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeExperts", HYBRID),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeExperts", dict(norm_topk_prob=True)),
    "qwen3_next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3NextExperts", HYBRID),
    "qwen4_exp_text": Family("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", "Qwen4ExpTextExperts",
                             HYBRID | dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                                           indexer_budget=4, indexer_compress_ratio=2)),
    "solar_open": Family("SolarOpenConfig", "SolarOpenForCausalLM", "SolarOpenExperts"),
    "zaya": Family("ZayaConfig", "ZayaForCausalLM", "ZayaExperts", dict(num_experts_per_tok=1)),
    # Families without a causal LM: their text model's last hidden state is compared instead.
    "deepseek_ocr2_text": Family("DeepseekOcr2TextConfig", "DeepseekOcr2TextModel", "DeepseekOcr2TextExperts",
                                 SPARSE),
    "diffusion_gemma_text": Family("DiffusionGemmaTextConfig", "DiffusionGemmaEncoderTextModel",
                                   "DiffusionGemmaTextExperts", GEMMA_MOE),
    "ernie4_5_vl_moe_text": Family("Ernie4_5_VLMoeTextConfig", "Ernie4_5_VLMoeTextModel", "Ernie4_5_VLMoeMoeExperts",
                                   SPARSE | dict(moe_intermediate_size=[32, 32], moe_num_experts=4, moe_k=2,
                                                 rope_parameters=dict(rope_type="default", mrope_section=[3, 3, 2]))),
    "glm4v_moe_text": Family("Glm4vMoeTextConfig", "Glm4vMoeTextModel", "Glm4vMoeTextExperts",
                             dict(rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2]))),
    "mistral_large4_text": Family("MistralLarge4TextConfig", "MistralLarge4TextModel", "MistralLarge4TextExperts",
                                  MLA),
    "openai_privacy_filter": Family("OpenAIPrivacyFilterConfig", "OpenAIPrivacyFilterModel",
                                    "OpenAIPrivacyFilterExperts"),
    "qwen3_omni_moe_talker_text": Family("Qwen3OmniMoeTalkerTextConfig", "Qwen3OmniMoeTalkerModel",
                                         "Qwen3OmniMoeTalkerTextExperts", dict(shared_expert_intermediate_size=64)),
    "qwen3_omni_moe_thinker_text": Family("Qwen3OmniMoeTextConfig", "Qwen3OmniMoeThinkerTextModel",
                                          "Qwen3OmniMoeThinkerTextExperts"),
    "qwen3_vl_moe_text": Family("Qwen3VLMoeTextConfig", "Qwen3VLMoeTextModel", "Qwen3VLMoeTextExperts"),
    "step3p7_text": Family("Step3p7TextConfig", "Step3p7TextModel", "Step3p7Experts", SPARSE | dict(sliding_window=4)),
    "unlimited_ocr_text": Family("UnlimitedOcrTextConfig", "UnlimitedOcrTextModel", "UnlimitedOcrTextExperts",
                                 SPARSE),
}


def _model(name, dtype=torch.float32, **overrides):
    family = FAMILIES[name]
    config_cls = getattr(transformers, family.config, None)
    if config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family.config}")
    fields = inspect.signature(config_cls.__init__).parameters
    config = config_cls(**{k: v for k, v in SIZES.items() if k in fields} | family.kwargs | overrides)
    torch.manual_seed(0)
    model = getattr(transformers, family.model)(config).to(DEVICE, dtype).eval()
    with torch.no_grad():  # random, non-trivial expert and router-bias weights
        for module in model.modules():
            if type(module).__name__ in SUPPORTED_EXPERTS:
                for p in module.parameters():
                    p.normal_(0, 0.08)
            if isinstance(getattr(module, "e_score_correction_bias", None), torch.Tensor):
                module.e_score_correction_bias.normal_(0, 0.05)
    return model


def _output(model, tokens):
    """A causal LM's logits, or a text model's last hidden state (fed embeddings: some, like
    Qwen3-Omni's talker, take no token ids)."""
    if isinstance(model, transformers.GenerationMixin):
        return model(tokens).logits
    return model(inputs_embeds=model.get_input_embeddings()(tokens)).last_hidden_state


def _stock_experts(model, name):
    return [m for m in model.modules() if type(m).__name__ == FAMILIES[name].experts]


# Clamped gating with values other than the defaults: tmoe takes them as runtime floats.
CLAMPED = {"gpt_oss_alpha_limit": ("gpt_oss", dict(swiglu_limit=0.3)),
           "step3p7_text_limit": ("step3p7_text", dict(swiglu_limits=[0.05]))}


@pytest.mark.parametrize("name", sorted(FAMILIES) + sorted(CLAMPED))
def test_family_matches_stock(name):
    """Logits (or the text model's hidden states) and greedy tokens equal stock's after the swap."""
    name, overrides = CLAMPED.get(name, (name, {}))
    model = _model(name, **overrides)
    if name == "gpt_oss" and overrides:
        for m in _stock_experts(model, name):
            m.alpha = 1.2
    tokens = torch.randint(3, VOCAB, (1, 6), device=DEVICE)
    generates = isinstance(model, transformers.GenerationMixin)
    with torch.no_grad():
        before = _output(model, tokens)
        greedy = model.generate(tokens, do_sample=False, max_new_tokens=3) if generates else None
        replaced = replace_moe_blocks(model, strict=True)  # raises if any experts module is left
        after = _output(model, tokens)
        swapped_greedy = model.generate(tokens, do_sample=False, max_new_tokens=3) if generates else None
    assert replaced >= 1 and not _stock_experts(model, name)
    assert any(isinstance(m, (TmoeExperts, TmoeLlama4TextMoe)) for m in model.modules())
    assert_close(after, before, torch.float32, name=f"{name} output")
    if generates:
        assert torch.equal(swapped_greedy, greedy)


@pytest.mark.parametrize("name", ["mixtral", "llama4_text"])
def test_second_swap_is_a_silent_no_op(name):
    model = _model(name)
    assert replace_moe_blocks(model, strict=True) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert replace_moe_blocks(model, strict=True) == 0


UNSUPPORTED = [  # (family, config overrides, what the warning says about its experts)
    ("mixtral", dict(hidden_act="relu"), "MixtralExperts: activation ReLU is not one of tmoe's"),
    ("gpt_oss", dict(swiglu_limit=-1.0), "GptOssExperts: swigluoai needs a finite alpha and a positive finite limit"),
]


@pytest.mark.parametrize("name, overrides, message", UNSUPPORTED)
def test_unsupported_configuration_is_reported(name, overrides, message):
    """A supported class whose configuration tmoe cannot run is named with the reason; strict raises."""
    model = _model(name, **overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        replace_moe_blocks(model, strict=True)
    with pytest.warns(UserWarning, match=re.escape(message)):
        assert replace_moe_blocks(model) == 0
    assert len(_stock_experts(model, name)) == 1


def test_clamped_non_silu_gate_is_reported():
    """tmoe clamps a silu gate only (Step3p7 forces silu; a gelu gate is set by hand here)."""
    model = _model("step3p7_text", swiglu_limits=[5.0])
    for experts in _stock_experts(model, "step3p7_text"):
        experts.act_fn = transformers.activations.ACT2FN["gelu"]
    with pytest.raises(ValueError, match=re.escape("Step3p7Experts: clamps the activated gate (limit=5.0) of a gelu")):
        replace_moe_blocks(model, strict=True)


def test_unknown_experts_class_warns_and_strict_raises():
    """An unknown *Experts class is named with the supported list; strict=True swaps nothing."""
    model = _model("mixtral")
    experts = model.model.layers[0].mlp.experts
    experts.__class__ = type("FancyExperts", (type(experts),), {})
    with pytest.raises(ValueError, match="FancyExperts: not a supported experts class"):
        replace_moe_blocks(model, strict=True)
    assert model.model.layers[0].mlp.experts is experts
    with pytest.warns(UserWarning, match=r"FancyExperts: .*\n.*tmoe supports: .*MixtralExperts") as record:
        assert replace_moe_blocks(model) == 0
    assert "model.layers.0.mlp.experts" in str(record[0].message)


def test_modulelist_experts_are_reported():
    """transformers 4.x-style experts (an ``experts`` ModuleList of per-expert MLPs) are named."""
    block = torch.nn.Module()
    block.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
    with pytest.warns(UserWarning, match="ModuleList: not a supported experts class"):
        assert replace_moe_blocks(torch.nn.Sequential(block)) == 0


def test_model_without_moe_warns_and_strict_raises():
    config = transformers.LlamaConfig(**{k: SIZES[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                                "num_hidden_layers", "num_attention_heads")})
    model = transformers.LlamaForCausalLM(config)
    with pytest.warns(UserWarning, match="LlamaForCausalLM has no MoE experts modules"):
        assert replace_moe_blocks(model) == 0
    with pytest.raises(ValueError, match="has no MoE experts modules"):
        replace_moe_blocks(model, strict=True)


@pytest.mark.parametrize("version", ["4.57.1", "5.14.0"])
def test_old_transformers_is_refused(monkeypatch, version):
    """4.x keeps experts as per-expert modules; early 5.x releases store some families differently."""
    model = _model("mixtral")
    # the live module: loading a model elsewhere in the session can re-register ``transformers``
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", version)
    with pytest.raises(RuntimeError, match=f"needs transformers >= 5.15; found {re.escape(version)}"):
        replace_moe_blocks(model)


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
