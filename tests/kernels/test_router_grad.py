"""The router's backward: dL/drouter_logits of tmoe.topk_route against float64 autograd of the
reference (the same picks, weights differentiable through the scores)."""
import pytest
import torch

import tmoe
from tmoe.reference import topk_route_reference
from tmoe.testing import assert_close
from tmoe.testing.tolerance import Tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = Tolerance(rel=1e-5, atol=1e-6, rtol=1e-4)


def _reference_grad(logits, ids, grad, scoring, renormalize, scale):
    x = logits.detach().double().requires_grad_()
    scores = torch.softmax(x, -1) if scoring == "softmax" else torch.sigmoid(x)
    w = scores.gather(1, ids.long())
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    (w * scale).backward(grad.double())
    return x.grad


@pytest.mark.parametrize("scoring,renormalize,scale,groups,bias,dtype", [
    ("softmax", True, 1.0, None, False, torch.float32),
    ("softmax", False, 1.0, None, False, torch.float32),
    ("sigmoid", True, 2.5, (4, 2), True, torch.float32),
    ("sigmoid", False, 1.0, None, False, torch.float32),
    ("softmax", True, 1.0, None, False, torch.bfloat16),
])
def test_router_gradient(scoring, renormalize, scale, groups, bias, dtype):
    m, e, topk = 13, 16, 3
    logits = torch.randn(m, e, device=DEVICE).to(dtype)
    logits[2, 5] = float("nan")  # reads as -inf: no gradient there
    logits.requires_grad_()
    corr = torch.randn(e, device=DEVICE) if bias else None
    kw = dict(scoring=scoring, renormalize=renormalize, routed_scaling_factor=scale, e_score_correction_bias=corr)
    if groups:
        kw.update(num_expert_group=groups[0], topk_group=groups[1])
    w, ids = tmoe.topk_route(logits, topk, **kw)
    _, ref_ids = topk_route_reference(logits.detach(), topk, **kw)
    assert torch.equal(ids, ref_ids)
    grad = torch.randn(m, topk, device=DEVICE)
    (got,) = torch.autograd.grad(w, logits, grad)
    assert got.dtype == dtype
    want = _reference_grad(logits.detach().float().nan_to_num(nan=float("-inf")), ids, grad, scoring, renormalize,
                           scale)
    assert got[2, 5] == 0
    assert_close(got, want, TOL if dtype == torch.float32 else dtype, name="drouter_logits")
