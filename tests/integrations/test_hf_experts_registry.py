"""``experts_implementation="tmoe"``: every experts class of the installed transformers that uses
the registry gives eager's logits on a tiny random model; loading, switching and compiling work."""
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tmoe.integrations.transformers  # noqa: E402,F401  (registers "tmoe")
import tmoe  # noqa: E402
from tests.integrations.hf_tiny import (  # noqa: E402
    DEVICE, FAMILIES, TINY, UNBUILT, experts_of, output, random_tokens, registry_classes, tiny_model,
)
from tmoe.integrations import hf_registry  # noqa: E402
from tmoe.integrations.hf_layout import eager_forward, is_registry_class, layout_of  # noqa: E402
from tmoe.testing import assert_close  # noqa: E402
from tmoe.testing.tolerance import Tolerance  # noqa: E402



@pytest.mark.parametrize("experts", registry_classes())
def test_registry_class_matches_eager(experts):
    """Logits (or a text model's hidden states) with "tmoe" equal "eager" on the same weights."""
    if experts in UNBUILT:
        pytest.skip(f"{experts}: {UNBUILT[experts]}")
    assert experts in TINY, f"{experts} uses the experts registry: add a tiny family for it to hf_tiny.FAMILIES"
    name = TINY[experts]
    model = tiny_model(name).eval()
    assert experts_of(model, experts), f"the tiny {name} model has no {experts}"
    tokens = random_tokens(2, 5)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warning is checked on its own below
        eager = output(model, tokens)
        model.set_experts_implementation("tmoe")
        got = output(model, tokens)
    assert model.config._experts_implementation == "tmoe" or any(
        getattr(m, "config", None) is not None and m.config._experts_implementation == "tmoe"
        for m in experts_of(model, experts))
    assert_close(got, eager, torch.float32, name=f"{name} output")


def test_from_pretrained_from_config_and_set(tmp_path):
    """``from_pretrained``/``from_config`` take "tmoe"; ``set_experts_implementation`` switches a loaded model."""
    model = tiny_model("qwen3_moe").eval()
    model.save_pretrained(tmp_path)
    tokens = random_tokens(1, 6)
    with torch.no_grad():
        eager = model(tokens).logits
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="tmoe").to(DEVICE).eval()
        assert loaded.config._experts_implementation == "tmoe"
        assert_close(loaded(tokens).logits, eager, torch.float32)
        fresh = transformers.AutoModelForCausalLM.from_config(model.config, experts_implementation="tmoe")
        assert fresh.config._experts_implementation == "tmoe"
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager").to(DEVICE).eval()
        reloaded.set_experts_implementation("tmoe")
        assert_close(reloaded(tokens).logits, eager, torch.float32)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_compiled_model_matches_eager(name):
    """``torch.compile`` of a block (fullgraph) and of the whole model keep working with "tmoe"."""
    model = tiny_model(name).eval()
    tokens = random_tokens(1, 5)
    x = torch.randn(1, 5, 64, device=DEVICE)
    block = model.model.layers[0].mlp
    with torch.no_grad():
        eager_logits, eager_block = model(tokens).logits, block(x)
        model.set_experts_implementation("tmoe")
        compiled_block = torch.compile(block, fullgraph=True)(x)
        compiled_logits = torch.compile(model)(tokens).logits
    for got, want in ((compiled_block, eager_block), (compiled_logits, eager_logits)):
        got, want = (t[0] if isinstance(t, tuple) else t for t in (got, want))
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "step3p7_text", "beam"])
def test_compiled_before_any_eager_call_trains(name):
    """A model compiled (fullgraph, dynamic) before its experts ever ran eagerly decides each
    module's layout while tracing (symbolic float attributes included): its logits and gradients
    equal eager's."""
    model = tiny_model(name)
    if not is_registry_class(type(experts_of(model, FAMILIES[name].experts)[0])):  # transformers 5.17's Step3p7Experts
        pytest.skip(f"transformers {transformers.__version__}'s {FAMILIES[name].experts} does not use the registry")
    model.set_experts_implementation("tmoe")
    tokens = random_tokens(2, 5)
    torch._dynamo.reset()
    # the layout is decided while dynamo traces; Inductor's codegen is test_compiled_model_matches_eager's
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    lm = isinstance(model, transformers.GenerationMixin)
    runs = []
    for forward in (compiled, model):
        model.zero_grad()
        out = forward(tokens).logits if lm else forward(
            inputs_embeds=model.get_input_embeddings()(tokens)).last_hidden_state
        out.float().square().mean().backward()
        runs.append((out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (got, got_grads), (want, want_grads) = runs
    # Inductor fuses and reorders the float32 ops of the rest of the model around tmoe's kernels
    whole_model = Tolerance(rel=2e-4, atol=2e-4, rtol=1e-3)  # grouped_mm experts show 8e-5 here too
    assert_close(got, want, whole_model, name="logits")
    assert len(got_grads) == len(want_grads) > 0
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        assert_close(a, b, whole_model, name=f"gradient {i}")


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "nemotron_h"])
def test_sentinel_ids_add_zero(name):
    """Expert-parallel sentinel ids (>= num_experts) contribute exactly 0."""
    model = tiny_model(name)
    experts = experts_of(model, FAMILIES[name].experts)[0]
    e = experts.down_proj.shape[0]
    x = torch.randn(6, 64, device=DEVICE)
    ids = torch.randint(0, e, (6, 2), device=DEVICE)
    ids[::2, 1] = e + torch.arange(3, device=DEVICE)  # sentinels
    weights = torch.rand(6, 2, device=DEVICE)
    with torch.no_grad():
        got = hf_registry.experts_forward(experts, x, ids, weights)
        want = eager_forward(type(experts))(experts, x, ids.clamp(max=e - 1), weights * (ids < e))
    assert_close(got, want, torch.float32)


def test_unsupported_module_runs_its_own_forward_and_warns_once():
    """An activation tmoe lacks: the class's own forward runs, with one warning naming why."""
    model = tiny_model("mixtral", hidden_act="relu").eval()
    tokens = random_tokens(1, 5)
    hf_registry._WARNED.clear()
    with torch.no_grad():
        eager = model(tokens).logits
        model.set_experts_implementation("tmoe")
        with pytest.warns(UserWarning, match=re.escape("MixtralExperts runs its own (eager) forward: activation ReLU")):
            got = model(tokens).logits
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(tokens)
    assert torch.equal(got, eager)


def test_post_expert_norm_is_named():
    """``has_post_expert_norm`` is refused with that reason (its norm is not in tmoe's kernels)."""
    experts = experts_of(tiny_model("muse_spark_text"), "MuseSparkExperts")[0]
    assert "has_post_expert_norm" in layout_of(experts)


def test_batch_invariant_rows_in_generate_and_training():
    """``set_batch_invariant``: a sequence's MoE rows (the experts module's, given the same rows:
    torch's CPU attention is not batch-invariant) are the same bits alone, at the end of a batch of
    three sequences, and in the training forward (grad enabled)."""
    model = tiny_model("qwen3_moe", "tmoe").eval()
    experts = experts_of(model, "Qwen3MoeExperts")
    assert tmoe.integrations.transformers.set_batch_invariant(model) == len(experts) > 0
    assert all(getattr(m, hf_registry.BATCH_INVARIANT) is True for m in experts)
    calls = []
    hook = experts[0].register_forward_hook(lambda mod, args, out: calls.append((args, out.detach())))
    tokens = random_tokens(3, 6)
    with torch.no_grad():
        model(tokens[:1])
        model(tokens)
    hook.remove()
    (one, out1), (three, _) = calls
    mixed = [torch.cat([b, a]) for a, b in zip(one, three)]  # the sequence's rows last
    with torch.no_grad():
        served = experts[0](*mixed)
    x = mixed[0].clone().requires_grad_()
    trained = experts[0](x, *mixed[1:])
    assert trained.grad_fn is not None
    assert torch.equal(served[-6:], out1) and torch.equal(trained[-6:].detach(), out1)
