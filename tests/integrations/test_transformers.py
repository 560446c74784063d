"""Drop-in use in tiny random Hugging Face MoE models (config objects only, no downloads)."""
import copy
import importlib
import inspect
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tmoe.integrations.transformers import (  # noqa: E402
    SUPPORTED_EXPERTS, TmoeExperts, TmoeLlama4TextMoe, replace_moe_blocks, unsupported_reason,
)
from tmoe.testing import assert_close  # noqa: E402

from tests.integrations.hf_tiny import DEVICE, FAMILIES, REGISTRY_ONLY, SIZES, random_tokens  # noqa: E402  (one table of tiny families)


def _model(name, dtype=torch.float32, **overrides):
    """Family ``name``'s stock tiny model; skips where the installed transformers lacks the family
    or a config field of ``overrides`` (an override it ignores would not reach the experts)."""
    family = FAMILIES[name]
    config_cls = getattr(transformers, family.config, None)
    if config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family.config}")
    fields = inspect.signature(config_cls.__init__).parameters
    missing = sorted(set(overrides) - set(fields))
    if missing:
        pytest.skip(f"transformers {transformers.__version__}'s {family.config} takes no {missing}")
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


def _skip_unless_installed_layout_is_tmoes(model, name):
    """An older transformers stores some families otherwise (transformers 5.17's Aria experts are
    fc1/fc2 modules): there the swap must refuse the class by name; then the test skips."""
    experts = FAMILIES[name].experts
    why = unsupported_reason(_stock_experts(model, name)[0])
    if why is not None:
        with pytest.raises(ValueError, match=re.escape(f"{experts}: {why}")):
            replace_moe_blocks(model, strict=True)
        pytest.skip(f"transformers {transformers.__version__}'s {experts}: {why}")


# Clamped gating with values other than the defaults: tmoe takes them as runtime floats.
CLAMPED = {"gpt_oss_alpha_limit": ("gpt_oss", dict(swiglu_limit=0.3)),
           "step3p7_text_limit": ("step3p7_text", dict(swiglu_limits=[0.05]))}


REPLACED = sorted(set(FAMILIES) - set(REGISTRY_ONLY))  # families replace_moe_blocks swaps


@pytest.mark.parametrize("name", REPLACED + sorted(CLAMPED))
def test_family_matches_stock(name):
    """Logits (or the text model's hidden states) and greedy tokens equal stock's after the swap."""
    name, overrides = CLAMPED.get(name, (name, {}))
    model = _model(name, **overrides)
    _skip_unless_installed_layout_is_tmoes(model, name)
    if name == "gpt_oss" and overrides:
        for m in _stock_experts(model, name):
            m.alpha = 1.2
    tokens = random_tokens(1, 6)
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
