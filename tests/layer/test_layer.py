"""tmoe.FusedMoE: router + experts against a per-expert PyTorch block, eager and compiled."""
import copy

import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import tmoe
from tmoe.reference import moe_reference, topk_route_reference
from tmoe.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(e, k, n):
    g = torch.Generator().manual_seed(1)
    mk = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(DEVICE)  # noqa: E731
    return [mk(n, k) for _ in range(e)], [mk(n, k) for _ in range(e)], [mk(k, n) for _ in range(e)], mk(e, k)


def test_from_experts_matches_per_expert_block():
    e, k, n, topk = 6, 64, 72, 2
    gate, up, down, router = _experts(e, k, n)
    layer = tmoe.FusedMoE.from_experts(gate, up, down, topk, router_weight=router)
    x = torch.randn(3, 5, k, device=DEVICE)
    out = layer(x)
    flat = x.reshape(-1, k)
    weights, ids = topk_route_reference(flat @ router.T, topk)
    ref = torch.zeros_like(flat)
    for m in range(flat.shape[0]):
        for t in range(topk):
            i = int(ids[m, t])
            ref[m] += weights[m, t] * (down[i] @ (F.silu(gate[i] @ flat[m]) * (up[i] @ flat[m])))
    assert out.shape == x.shape
    assert_close(out.reshape(-1, k), ref, torch.float32)


def test_deepseek_style_routing_and_compile():
    e, k, n, topk = 16, 64, 64, 4
    layer = tmoe.FusedMoE(e, k, n, topk, scoring="sigmoid", num_expert_group=4, topk_group=2,
                          routed_scaling_factor=2.5, score_correction_bias=True, dtype=torch.float32, device=DEVICE)
    with torch.no_grad():
        layer.e_score_correction_bias.copy_(torch.randn(e) * 0.1)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for m in (3, 9, 33):
        x = torch.randn(m, k, device=DEVICE)
        logits = x @ layer.router_weight.T
        w, ids = topk_route_reference(logits, topk, scoring="sigmoid", num_expert_group=4, topk_group=2,
                                      e_score_correction_bias=layer.e_score_correction_bias,
                                      routed_scaling_factor=2.5)
        ref = moe_reference(x, layer.w1, layer.w2, w, ids)
        assert_close(layer(x), ref, torch.float32)
        assert_close(compiled(x), ref, torch.float32, name=f"compiled(M={m})")
        frames.append(counter.frame_count)
    assert frames[0] == frames[-1], f"recompiled: frames per call {frames}"  # fullgraph: no breaks either


def test_parameters_train_as_constructed_and_inference_pays_nothing():
    """FusedMoE's router and expert weights require grad as built (an optimizer given ``parameters()``
    trains them); under no_grad and inference_mode no graph is recorded and the output is the frozen
    layer's, bitwise."""
    moe = tmoe.FusedMoE(num_experts=4, hidden_size=64, intermediate_size=64, topk=2, dtype=torch.float32,
                        device=DEVICE)
    assert all(p.requires_grad for p in (moe.router_weight, moe.w1, moe.w2))
    x = torch.randn(5, 64, device=DEVICE)
    frozen = copy.deepcopy(moe).requires_grad_(False)
    ref = frozen(x)
    assert ref.grad_fn is None
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out = moe(x)
        assert out.grad_fn is None and not out.requires_grad
        assert torch.equal(out, ref)
    moe(x).square().mean().backward()
    assert all(p.grad is not None for p in (moe.router_weight, moe.w1, moe.w2))
