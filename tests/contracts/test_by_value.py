"""The layer by value: ``FusedMoEModularKernel`` hands ``tmoe::modular_forward`` what the kernel
is (``KernelSpec``: kinds, int parameters, group name, quant config, chunk size) as primitive
arguments, never a handle. So blocks compiled one by one share their graphs (the number of graphs
does not grow with the number of layers), and layers copy, pickle and save, each copy its own."""
import copy
import gc
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import tmoe
from tmoe.reference import dequantize_fp8_reference, moe_reference, topk_route_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

transformers = pytest.importorskip("transformers")

from tmoe.integrations.transformers import TmoeExperts, replace_moe_blocks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
E, N, K, TOPK = 4, 64, 64, 3
BLOCK_MS = (3, 17, 64)
SEQ_LENS = (5, 11)
COPIES = ("deepcopy", "pickle", "torch.save")


def _twin(obj, how: str, tmp_path):
    """``obj`` through one of the three ways a module is copied."""
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    path = tmp_path / "obj.pt"
    torch.save(obj, path)
    return torch.load(path, weights_only=False)


def _block_reference(block: tmoe.FusedMoE, x: torch.Tensor) -> torch.Tensor:
    weights, ids = topk_route_reference(F.linear(x, block.router_weight), block.routing.topk)
    return moe_reference(x, block.w1, block.w2, weights, ids)


def _tiny_mixtral(num_layers: int = 4):
    """A random 4-expert top-2 Mixtral with its experts replaced by tmoe's (fp32, eval)."""
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "MixtralExperts":
                module.gate_up_proj.normal_(0, 0.08)
                module.down_proj.normal_(0, 0.08)
    assert replace_moe_blocks(model) == num_layers
    return model


def _logits(model, tokens):
    # use_cache=False: with a KV cache each decoder layer guards on its own cache slot
    # (cache.layers[layer_idx].is_initialized), a per-layer recompile of transformers', not tmoe's
    return model(tokens, use_cache=False).logits


def _calls_layer_op(counter: CompileCounterWithBackend) -> bool:
    ops = (torch.ops.tmoe.modular_forward, torch.ops.tmoe.modular_forward_,  # dynamo records the packets
           torch.ops.tmoe.modular_forward_train)
    ops += tuple(op.default for op in ops)
    return any(node.target in ops for gm in counter.graphs for node in gm.graph.nodes)


def test_blocks_compiled_one_by_one_share_graphs():
    """The torchtitan way: each of 12 blocks compiled on its own; with the kernel passed by
    value the graphs of block 0 serve all of them (a per-instance handle would recompile per block
    and, past torch._dynamo.config.recompile_limit (8), raise FailOnRecompileLimitHit under fullgraph).

    Every compiled output is checked against the float32 reference of its own block, so a graph
    that kept block 0's weights would fail; against the eager block at M=3 for every block and
    at every M for the first and the last (the interpreter runs an eager M=64 call in ~1 s, one
    per block would double the test's time for nothing the reference does not already check)."""
    torch._dynamo.reset()
    # inductor, as torchtitan compiles: its C++ codegen costs a few seconds once (block 0) and
    # nothing after, since the later blocks reuse block 0's graphs
    counter = CompileCounterWithBackend("inductor")
    blocks = [tmoe.FusedMoE(E, K, N, TOPK, dtype=torch.float32, device=DEVICE) for _ in range(12)]
    assert len(blocks) > torch._dynamo.config.recompile_limit  # past it, a recompile per block would raise
    frames_after_first = None
    with torch.no_grad():
        for i, block in enumerate(blocks):
            block.compile(fullgraph=True, dynamic=True, backend=counter)
            for m in BLOCK_MS:
                x = torch.randn(m, K, device=DEVICE)
                out = block(x)
                assert_close(out, _block_reference(block, x), torch.float32, name=f"block {i} (M={m})")
                if m == BLOCK_MS[0] or i in (0, len(blocks) - 1):
                    assert_close(out, block.forward(x), torch.float32, name=f"block {i} (M={m}) vs eager")
            if i == 0:
                frames_after_first = counter.frame_count
                assert _calls_layer_op(counter), "the layer op is not in block 0's graph"
    assert counter.frame_count == frames_after_first, (
        f"{counter.frame_count} graphs after {len(blocks)} blocks, {frames_after_first} after the first: "
        "the graphs grow with the number of layers")


def test_hf_decoder_layers_compiled_one_by_one_share_graphs():
    torch._dynamo.reset()
    model = _tiny_mixtral()
    tokens = {s: torch.randint(0, 128, (1, s), device=DEVICE) for s in SEQ_LENS}
    # aot_eager: AOTAutograd traces the layer op's fake and functionalizes like inductor does;
    # inductor's CPU codegen of a whole decoder layer takes ~40 s here and tests nothing more of tmoe
    counter = CompileCounterWithBackend("aot_eager")
    layers = model.model.layers
    with torch.no_grad():
        eager = {s: _logits(model, t) for s, t in tokens.items()}
        layers[0].compile(fullgraph=True, dynamic=True, backend=counter)
        for s, t in tokens.items():
            assert_close(_logits(model, t), eager[s], torch.float32, name=f"layer 0 compiled, seq {s}")
        frames_one_layer = counter.frame_count
        assert _calls_layer_op(counter), "the layer op is not in the decoder layer's graph"
        for layer in layers[1:]:
            layer.compile(fullgraph=True, dynamic=True, backend=counter)
        for s, t in tokens.items():
            assert_close(_logits(model, t), eager[s], torch.float32, name=f"all layers compiled, seq {s}")
    assert counter.frame_count == frames_one_layer, (
        f"{counter.frame_count} graphs with {len(layers)} compiled layers, {frames_one_layer} with one")


def _check_twin_layer(layer, twin, x: torch.Tensor) -> None:
    """Same output; the twin runs without the original; its weights are its own."""
    want = layer(x)
    assert torch.equal(twin(x), want)
    assert twin.kernel.spec == layer.kernel.spec
    twin.w2.mul_(2)
    assert_close(twin(x), 2 * want, torch.float32, name="copy with w2 doubled")
    assert torch.equal(layer(x), want), "changing the copy's w2 changed the original"
    del layer
    gc.collect()
    assert_close(twin(x), 2 * want, torch.float32, name="copy after the original is gone")


@pytest.mark.parametrize("how", COPIES)
def test_fused_moe_copies(how, tmp_path):
    layer = tmoe.FusedMoE(E, K, N, TOPK, dtype=torch.float32, device=DEVICE)
    x = torch.randn(17, K, device=DEVICE)
    with torch.no_grad():
        assert_close(layer(x), _block_reference(layer, x), torch.float32)
        twin = _twin(layer, how, tmp_path)
        assert twin is not layer and twin.w2.data_ptr() != layer.w2.data_ptr()
        _check_twin_layer(layer, twin, x)


def _kernel_cases():
    fp8_block = tmoe.FusedMoEQuantConfig(FP8, block_shape=(32, 32))
    return {
        "noep": lambda: tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts()),
        "batched": lambda: tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(24, E),
                                                      tmoe.BatchedTritonExperts(24)),
        "fp8_block": lambda: tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(),
                                                        tmoe.TritonExperts(quant_config=fp8_block)),
    }


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("name", list(_kernel_cases()))
def test_modular_kernel_copies(name, how, tmp_path):
    # M=17, topk=2 over 4 experts: at most 17 tokens per expert, within the batched capacity 24
    p = make_problem(MoEShape(17, E, N, K, 2), torch.float32, "uniform", seed=3, device=DEVICE)
    kernel = _kernel_cases()[name]()
    w1, w2, options, tol = p.w1, p.w2, {}, torch.float32
    if name == "fp8_block":
        w1, s1 = tmoe.quantize_weight_per_block_fp8(p.w1, (32, 32))
        w2, s2 = tmoe.quantize_weight_per_block_fp8(p.w2, (32, 32))
        options, tol = dict(w1_scale=s1, w2_scale=s2), "fp8"
        ref_w1, ref_w2 = dequantize_fp8_reference(w1, s1, (32, 32)), dequantize_fp8_reference(w2, s2, (32, 32))
    else:
        ref_w1, ref_w2 = w1, w2
    args = (p.x, w1, w2, p.topk_weights, p.topk_ids)
    want = kernel(*args, **options)
    assert_close(want, moe_reference(p.x, ref_w1, ref_w2, p.topk_weights, p.topk_ids), tol, name=name)
    twin = _twin(kernel, how, tmp_path)
    assert twin is not kernel
    assert twin.spec == kernel.spec
    assert torch.equal(twin(*args, **options), want)
    del kernel
    gc.collect()
    assert torch.equal(twin(*args, **options), want), "the copy changed when the original was deleted"


@pytest.mark.parametrize("how", COPIES)
def test_hf_model_copies(how, tmp_path):
    model = _tiny_mixtral(num_layers=1)
    tokens = torch.randint(0, 128, (1, 11), device=DEVICE)
    with torch.no_grad():
        want = _logits(model, tokens)
        twin = _twin(model, how, tmp_path)
        experts = twin.model.layers[0].mlp.experts
        assert isinstance(experts, TmoeExperts)
        assert experts.kernel.spec == model.model.layers[0].mlp.experts.kernel.spec
        assert torch.equal(_logits(twin, tokens), want)
        experts.down_proj[0].mul_(2)  # expert 0 of layer 0: 11 tokens top-2 of 4 experts reach it
        changed = _logits(twin, tokens)
        assert not torch.allclose(changed, want), "doubling an expert's down_proj did not change the copy"
        assert torch.equal(_logits(model, tokens), want), "changing the copy changed the original"
        del model
        gc.collect()
        assert torch.equal(_logits(twin, tokens), changed)


def _spec(pf, experts, **kwargs):
    return tmoe.FusedMoEModularKernel(pf, experts, **kwargs).spec


def test_spec_is_the_configuration():
    noep = lambda **q: _spec(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(**q))  # noqa: E731
    batched = lambda cap, **q: _spec(tmoe.BatchedPrepareAndFinalize(cap, E),  # noqa: E731
                                     tmoe.BatchedTritonExperts(cap, **q))
    block = tmoe.FusedMoEQuantConfig(FP8, block_shape=(32, 32))
    assert noep() == noep() and hash(noep()) == hash(noep())
    assert batched(8) == batched(8)
    assert noep(quant_config=block) == noep(quant_config=tmoe.FusedMoEQuantConfig(FP8, block_shape=[32, 32]))
    distinct = [
        noep(), batched(8), batched(16),
        noep(quant_config=block), noep(quant_config=tmoe.FusedMoEQuantConfig(FP8, block_shape=(64, 32))),
        noep(quant_config=tmoe.FusedMoEQuantConfig(FP8)), batched(8, quant_config=block),
        _spec(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(), chunk_size=64),
        _spec(tmoe.BatchedPrepareAndFinalize(8, 2), tmoe.BatchedTritonExperts(8)),
    ]
    assert len(set(distinct)) == len(distinct), distinct


def test_constructor_errors():
    with pytest.raises(ValueError, match="chunk_size"):
        tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(), chunk_size=0)
    with pytest.raises(TypeError, match="quant_config"):
        tmoe.TritonExperts("fp8")
    with pytest.raises(ValueError, match=r"max_num_tokens=6.*max_num_tokens=8"):
        tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(6, 2), tmoe.BatchedTritonExperts(8))


_WRONG_EXPERTS = """
import torch, tmoe
from tmoe.testing.strategies import MoEShape, make_problem
p = make_problem(MoEShape(17, 4, 64, 64, 2), torch.float32, "uniform", seed=3)
kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(6, 2), tmoe.BatchedTritonExperts(6))
try:
    kernel(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
except ValueError as err:
    print("ValueError:", err)
else:
    print("no error")
"""


def test_batched_local_experts_must_match_weights():
    """A BatchedPrepareAndFinalize for 2 local experts fed 4-expert weights: a ValueError before
    any launch (the dispatch would otherwise write batches past the 2 allocated), also in a
    fresh process, where a write out of bounds would show as a crash."""
    p = make_problem(MoEShape(17, E, N, K, 2), torch.float32, "uniform", seed=3, device=DEVICE)
    kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(6, 2), tmoe.BatchedTritonExperts(6))
    with pytest.raises(ValueError, match=r"num_local_experts=2.*4 experts"):
        kernel(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_WRONG_EXPERTS)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, f"returncode {run.returncode}\n{run.stderr[-2000:]}"
    assert "ValueError:" in run.stdout and "num_local_experts=2" in run.stdout, run.stdout + run.stderr[-2000:]
