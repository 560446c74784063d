"""Training through ``experts_implementation="tmoe"``: one backward gives eager's logits, loss and
gradients (float32 rounding), PEFT LoRA on the experts gets eager's LoRA gradients, a compiled
block trains, and after an optimizer step tmoe reads the updated weights. These need the layer's
backward (autograd on ``tmoe::modular_forward``)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tmoe.integrations.transformers  # noqa: E402,F401  (registers "tmoe")
from tests.integrations.hf_tiny import (  # noqa: E402
    DEVICE, FAMILIES, TINY, UNBUILT, experts_of, output, random_tokens, registry_classes, tiny_model,
)
from tmoe.integrations.hf_layout import layout_of  # noqa: E402
from tmoe.testing import RecordOps, assert_close, rel_error  # noqa: E402

VOCAB = FAMILIES["mixtral"].kwargs.get("vocab_size", 96)


def _loss(model, tokens):
    """Cross-entropy on logits; on hidden states (families without a head) a fixed random linear
    probe, well conditioned where a mean square of normalized states is ~1 with vanishing gradients."""
    out = output(model, tokens)
    if out.shape[-1] == VOCAB:
        return out, torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return out, (out * probe.to(out.device, out.dtype)).sum()


def _step(model, tokens):
    """(output, loss, {name: grad}) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out, loss = _loss(model, tokens)
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(got, want, what, exact=None):
    """tmoe's step equals eager's within float32 rounding; with ``exact`` (eager in float64), the
    loss and each gradient are instead as close to float64 as eager's float32 ones are (twice their
    error, 1e-5 of slack): a loss and gradients through a whole model round more than one layer's
    output does (openai_privacy_filter: eager's float32 loss is 1.4e-5 from float64, tmoe's 3.7e-6)."""
    (out, loss, grads), (out_e, loss_e, grads_e) = got, want
    assert_close(out, out_e, torch.float32, name=f"{what} output")
    if exact is None:
        assert_close(loss, loss_e, torch.float32, name=f"{what} loss")
    else:
        err, eager_err = rel_error(loss, exact[1]), rel_error(loss_e, exact[1])
        assert err <= 2 * eager_err + 1e-5, f"{what} loss: {err:.2e} from float64, eager {eager_err:.2e}"
    assert grads.keys() == grads_e.keys()
    for name in grads_e:
        if exact is None:
            assert_close(grads[name], grads_e[name], torch.float32, name=f"{what} grad {name}")
            continue
        ref = exact[2][name]
        err, eager_err = rel_error(grads[name], ref), rel_error(grads_e[name], ref)
        assert err <= 2 * eager_err + 1e-5, f"{what} grad {name}: {err:.2e} from float64, eager {eager_err:.2e}"


def _float64_step(model, tokens):
    """``_step`` of a float64 copy with eager experts, or None for a family whose own code does not
    run in float64 (a float32 buffer it multiplies with): then tmoe is held to eager's float32 step."""
    try:
        return _step(copy.deepcopy(model).double(), tokens)
    except RuntimeError as err:
        if "dtype" not in str(err):
            raise
        return None


def _tokens():
    return random_tokens(2, 5)


@pytest.mark.parametrize("experts", registry_classes())
def test_backward_matches_eager(experts):
    """Every parameter's gradient, the logits and the loss equal eager's."""
    if experts in UNBUILT:
        pytest.skip(f"{experts}: {UNBUILT[experts]}")
    name = TINY[experts]
    model = tiny_model(name).train()
    tokens = _tokens()
    exact = _float64_step(model, tokens)
    want = _step(model, tokens)
    model.set_experts_implementation("tmoe")
    got = _step(model, tokens)
    _assert_same_step(got, want, name, exact)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_peft_lora_on_experts_matches_eager(name):
    """PEFT's ``target_parameters`` LoRA on gate_up_proj/down_proj: the LoRA gradients equal eager's."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    model = peft.get_peft_model(tiny_model(name), config).base_model.model.train()  # the LM, LoRA injected
    tokens = _tokens()
    want = _step(model, tokens)
    assert any("lora_" in n for n in want[2]), "LoRA parameters got no gradient"
    model.set_experts_implementation("tmoe")
    _assert_same_step(_step(model, tokens), want, f"{name} LoRA")


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_peft_lora_runs_fused(name):
    """With tmoe, PEFT's adapted expert weight W + s * lhs @ rhs feeds nothing: the factors reach
    tmoe's adapter ops, and the backward runs no bmm (eager's backward of the baddbmm does). PEFT
    still forms the sum once per forward when it registers its parametrization (torch's
    consistency check), a value nothing reads."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    model = peft.get_peft_model(tiny_model(name), config).base_model.model.train()
    tokens = _tokens()

    def ops():
        model.zero_grad(set_to_none=True)
        with RecordOps() as forward:
            _, loss = _loss(model, tokens)
        with RecordOps() as backward:
            loss.backward()
        return forward.names, backward.names

    eager = ops()
    model.set_experts_implementation("tmoe")
    fused = ops()
    assert "aten::bmm" in eager[1] and "aten::bmm" not in fused[1]
    assert "tmoe::moe_lora_token_rows" in fused[1]


def test_compiled_block_trains():
    """A sparse block compiled with fullgraph=True: gradients of its input and weights equal eager's."""
    block = tiny_model("qwen3_moe").model.layers[0].mlp
    x = torch.randn(2, 5, 64, device=DEVICE, requires_grad=True)

    def step(fn):
        block.zero_grad(set_to_none=True)
        x.grad = None
        out = fn(x)
        out = out[0] if isinstance(out, tuple) else out
        out.square().mean().backward()
        return out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in block.named_parameters()}

    eager = step(block)
    block.experts.config._experts_implementation = "tmoe"
    compiled = step(torch.compile(block, fullgraph=True))
    assert_close(compiled[0], eager[0], torch.float32, name="block output")
    assert_close(compiled[1], eager[1], torch.float32, name="input grad")
    for name in eager[2]:
        assert_close(compiled[2][name], eager[2][name], torch.float32, name=f"grad {name}")


@pytest.mark.parametrize("name", ["gpt_oss", "openai_privacy_filter", "mixtral"])
def test_optimizer_step_reaches_the_weights(name):
    """Transposed (GPT-OSS, also interleaved; OpenAI privacy filter) and plain layouts: after an
    AdamW step on each, tmoe's output equals eager's on the updated weights."""
    model = tiny_model(name).train()
    layout = layout_of(experts_of(model, FAMILIES[name].experts)[0])
    assert not isinstance(layout, str)
    model.set_experts_implementation("tmoe")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = _tokens()
    _step(model, tokens)
    optimizer.step()
    with torch.no_grad():
        stepped = output(model, tokens)
        reference = copy.deepcopy(model)
        reference.set_experts_implementation("eager")
        assert_close(stepped, output(reference, tokens), torch.float32, name=f"{name} after a step")
