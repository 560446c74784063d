"""Tiny random Hugging Face MoE models for the experts-registry tests (config objects only, no
downloads), and the experts classes of the installed transformers that use the registry."""
from __future__ import annotations

import importlib
import inspect
import pathlib
from dataclasses import dataclass, field

import pytest
import torch
import transformers

from tmoe.integrations.hf_layout import is_registry_class

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where tmoe's kernels run in this process
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


FAMILIES = {  # keyed by model name; TINY below keys them by experts class
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


# Families whose experts classes only the experts registry serves (replace_moe_blocks does not know them).
REGISTRY_ONLY = {
    "ergo": Family("ErgoConfig", "ErgoForCausalLM", "ErgoExpertProjections",
                   dict(num_dense_blocks=0, first_dense_intermediate_size=64, shared_intermediate_size=64)),
    "nemotron_h": Family("NemotronHConfig", "NemotronHForCausalLM", "NemotronHExperts"),
    "deepseek_v4": Family("DeepseekV4Config", "DeepseekV4ForCausalLM", "DeepseekV4Experts"),
    "muse_spark_text": Family("MuseSparkTextConfig", "MuseSparkTextModel", "MuseSparkExperts",
                              dict(moe_hidden_size=32)),
    "inkling2_text": Family("Inkling2TextConfig", "Inkling2ForCausalLM", "Inkling2Experts", dict(unpadded_vocab_size=VOCAB)),
    "inkling2_loop_text": Family("Inkling2LoopTextConfig", "Inkling2LoopForCausalLM", "Inkling2LoopExperts",
                                 dict(unpadded_vocab_size=VOCAB)),
}
FAMILIES |= REGISTRY_ONLY
TINY = {family.experts: name for name, family in FAMILIES.items()}  # experts class -> one family using it
# Registry classes without a tiny model here, and why.
UNBUILT = {
    "Glm5NextTextExperts": "its text config validates a production attention layout (no tiny one found)",
    "HYV4Experts": "its tiny config builds no sparse layer (no tiny one found)",
    "HYV4VLExperts": "its tiny config builds no sparse layer (no tiny one found)",
}


def registry_classes() -> list[str]:
    """Every experts class of the installed transformers that carries ``@use_experts_implementation``
    (found by reading each model's modeling file, then checking the imported class)."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    names = set()
    for path in root.glob("*/modeling_*.py"):
        if "@use_experts_implementation" not in path.read_text():
            continue
        module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        names |= {n for n, c in vars(module).items()
                  if inspect.isclass(c) and c.__module__ == module.__name__ and is_registry_class(c)
                  and "forward" in vars(c)}
    return sorted(names)


def experts_of(model: torch.nn.Module, experts: str) -> list[torch.nn.Module]:
    """The model's experts modules of class ``experts`` (or a subclass, as Ergo's)."""
    return [m for m in model.modules() if any(c.__name__ == experts for c in type(m).__mro__)]


def tiny_model(name: str, implementation: str = "eager", dtype: torch.dtype = torch.float32,
               **overrides) -> torch.nn.Module:
    """Family ``name``'s tiny model on ``DEVICE``, seeded, with random non-trivial expert and
    router-bias weights (skips the test where the installed transformers lacks the family)."""
    family = FAMILIES[name]
    config_cls, model_cls = getattr(transformers, family.config, None), getattr(transformers, family.model, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family.model}")
    fields = inspect.signature(config_cls.__init__).parameters
    config = config_cls(**{k: v for k, v in SIZES.items() if k in fields} | family.kwargs | overrides)
    torch.manual_seed(0)
    model = model_cls._from_config(config, experts_implementation=implementation, dtype=dtype)
    with torch.no_grad():
        for module in experts_of(model, family.experts):
            for p in module.parameters():
                p.normal_(0, 0.08)
        for module in model.modules():
            if isinstance(getattr(module, "e_score_correction_bias", None), torch.Tensor):
                module.e_score_correction_bias.normal_(0, 0.05)
    return model.to(DEVICE)


def random_tokens(batch: int, length: int) -> torch.Tensor:
    """Random token ids (past the special ones), ``(batch, length)`` int64 on ``DEVICE``."""
    return torch.randint(3, VOCAB, (batch, length), device=DEVICE)


def output(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """A causal LM's logits, or a text model's last hidden state (fed embeddings: some, like
    Qwen3-Omni's talker, take no token ids)."""
    if isinstance(model, transformers.GenerationMixin):
        return model(tokens).logits
    return model(inputs_embeds=model.get_input_embeddings()(tokens)).last_hidden_state
