"""Gradients of the layer against the float64 autograd reference (``tmoe.reference.moe_reference``)."""
from __future__ import annotations

import torch

from tmoe.reference import moe_reference

GRAD_INPUTS = ("hidden_states", "w1", "w2", "topk_weights", "w1_bias", "w2_bias")


def layer_grads(fn, inputs: dict[str, torch.Tensor | None], grad_out: torch.Tensor,
                **options) -> dict[str, torch.Tensor]:
    """{name: dL/dname} of ``fn(x, w1, w2, topk_weights, topk_ids, **options)`` with L = <out, grad_out>,
    for every input of ``GRAD_INPUTS`` that is given and requires grad."""
    names = [n for n in GRAD_INPUTS if inputs.get(n) is not None and inputs[n].requires_grad]
    biases = {n: inputs.get(n) for n in ("w1_bias", "w2_bias")}
    out = fn(inputs["hidden_states"], inputs["w1"], inputs["w2"], inputs["topk_weights"], inputs["topk_ids"],
             **biases, **options)
    grads = torch.autograd.grad(out, [inputs[n] for n in names], grad_out)
    return dict(zip(names, grads))


def reference_grads(inputs: dict[str, torch.Tensor | None], grad_out: torch.Tensor,
                    **options) -> dict[str, torch.Tensor]:
    """``layer_grads`` of ``moe_reference`` in float64, on detached float64 copies of the inputs."""
    copies = {n: (t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                  and t.is_floating_point() else t) for n, t in inputs.items()}

    def ref(x, w1, w2, topk_weights, topk_ids, **kw):
        kw.setdefault("activation", "silu")
        return moe_reference(x, w1, w2, topk_weights, topk_ids, dtype=torch.float64, **kw)

    return layer_grads(ref, copies, grad_out.double(), **options)
