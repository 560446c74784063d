"""torch.compile(fullgraph=True, dynamic=True): one graph, no recompiles over M, equal to eager."""
import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import tmoe
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TwoMoELayers(nn.Module):
    """Two modular-kernel layers around ordinary torch ops, like a tiny MoE transformer."""

    def __init__(self, kernel: tmoe.FusedMoEModularKernel, e: int, n: int, k: int, topk: int) -> None:
        super().__init__()
        self.kernel, self.topk = kernel, topk
        self.router = nn.Linear(k, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(2, e, 2 * n, k) / k**0.5, requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(2, e, k, n) / n**0.5, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in range(2):
            weights, ids = torch.topk(torch.softmax(self.router(x), dim=-1), self.topk)
            x = x + self.kernel(torch.nn.functional.layer_norm(x, x.shape[-1:]), self.w1[layer], self.w2[layer],
                                weights, ids.to(torch.int32))
        return x


def _compile_over_sizes(fn, make_input, sizes, backend: str = "inductor"):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for m in sizes:
        args = make_input(m)
        assert_close(compiled(*args), fn(*args), torch.float32, name=f"compiled(M={m})")
    return counter


def test_fused_experts_compiles_once():
    # topk = 4, not 2: dynamo's duck sizing would tie M to topk when the first M equals it
    def make(m):
        p = make_problem(MoEShape(m, 8, 100, 72, 4), torch.float32, "uniform", seed=m, device=DEVICE)
        return p.x, p.w1, p.w2, p.topk_weights, p.topk_ids

    counter = _compile_over_sizes(lambda *a: tmoe.fused_experts(*a), make, [2, 7, 64, 200])
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
    one = make(1)  # M=1 may specialise once; it must be right
    assert_close(torch.compile(tmoe.fused_experts, fullgraph=True, dynamic=True)(*one), tmoe.fused_experts(*one),
                 torch.float32)


def test_bfloat16_router_weights_compile():
    """A model's bf16 router weights: the compiled layer (cast, op and fake) equals eager on their float32 cast."""
    p = make_problem(MoEShape(6, 4, 64, 48, 2), torch.float32, "uniform", seed=4, device=DEVICE)
    half = p.topk_weights.to(torch.bfloat16)
    torch._dynamo.reset()
    out = torch.compile(tmoe.fused_experts, fullgraph=True)(p.x, p.w1, p.w2, half, p.topk_ids)
    assert torch.equal(out, tmoe.fused_experts(p.x, p.w1, p.w2, half.float(), p.topk_ids))


@pytest.mark.parametrize("fmt", ["standard", "batched"])
def test_two_layer_model_compiles_once(fmt):
    e, n, k, topk = 4, 64, 64, 3  # topk != 2 = the first M (duck sizing)
    if fmt == "standard":
        kernel = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts())
    else:
        kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(64, e), tmoe.BatchedTritonExperts(64))
    model = TwoMoELayers(kernel, e, n, k, topk).to(DEVICE)
    with torch.no_grad():
        # dynamo's frames and AOTAutograd's graphs are what recompiles; Inductor's codegen of the
        # layer is test_fused_experts_compiles_once's (and test_by_value's blocks'), so aot_eager here
        counter = _compile_over_sizes(model, lambda m: (torch.randn(m, k, device=DEVICE),), [2, 3, 17, 64, 300],
                                      backend="aot_eager")
        assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
        one = torch.randn(1, k, device=DEVICE)  # M=1 may specialise once; it must be right
        assert_close(torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")(one), model(one),
                     torch.float32)


def test_compile_cache_keys_carry_the_ops_sources(tmp_path):
    """torch.compile's caches key a graph on its forward; the backward the layer op traces (and
    its ops' schemas) is not in the key. Importing tmoe appends a digest of tmoe/ops' sources to
    ``torch.compiler.config.cache_key_tag``: once, after a tag the user set, and changed by any edit
    of those sources, so an upgraded tmoe misses a warm cache instead of replaying stale ops."""
    import shutil

    from tmoe.ops import cache_tag

    tag = f"tmoe-ops-{cache_tag.ops_digest()}"
    assert tag in torch.compiler.config.cache_key_tag.split("|")
    with torch.compiler.config.patch(cache_key_tag="user"):  # restored on exit (a monkeypatch would delete it)
        assert cache_tag.tag_compile_caches() == tag and cache_tag.tag_compile_caches() == tag
        assert torch.compiler.config.cache_key_tag == f"user|{tag}"
    assert tag in torch.compiler.config.cache_key_tag.split("|")
    copy = tmp_path / "ops"
    shutil.copytree(cache_tag.ops_digest.__defaults__[0], copy)
    assert cache_tag.ops_digest(copy) == cache_tag.ops_digest()
    with open(copy / "backward.py", "a") as f:
        f.write("\n")
    assert cache_tag.ops_digest(copy) != cache_tag.ops_digest()
