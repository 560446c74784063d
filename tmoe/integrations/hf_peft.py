"""PEFT's ``target_parameters`` LoRA on transformers' experts, run fused by tmoe.

PEFT adapts a 3-D expert parameter by registering a parametrization on it while the experts
module runs (``peft.tuners.lora.layer.ParamWrapper``); with one adapter it keeps the factors
(``_LoraFactorsProxy``: the parameter reads as ``W + scaling * lhs @ rhs``, formed by a
``baddbmm`` on every forward). ``peft_adapters`` finds those factors and hands the stored ``W``
and the factors to ``tmoe.fused_experts``, which never forms the sum; the factors are views of
PEFT's own ``lora_A``/``lora_B`` weights, so their gradients reach them. A parametrization of any
other kind (several active adapters, PEFT's materialized delta) is read as PEFT gives it."""
from __future__ import annotations

import torch
from torch import nn

_FACTORS_PROXY = "_LoraFactorsProxy"


def _factors(experts: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None:
    """(stored W, lhs, rhs, scaling) of a parameter PEFT adapts with its factors, else None."""
    parametrizations = getattr(experts, "parametrizations", None)
    if parametrizations is None or name not in parametrizations:
        return None
    chain = parametrizations[name]
    if len(chain) != 1 or type(chain[0]).__name__ != _FACTORS_PROXY:
        return None
    proxy = chain[0]
    return chain.original, proxy.lhs, proxy.rhs, float(proxy.scaling)


def peft_adapters(experts: nn.Module, up: str, transposed: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """({up: W1, "down_proj": W2} stored tensors to read instead of the parametrized attributes,
    the adapters as ``tmoe.fused_experts`` keyword arguments); both empty when PEFT adapts neither
    weight with its factors (or the two adapters' scalings differ). ``transposed``: the weights are
    stored (E, in, out), where PEFT's delta is lhs @ rhs in that layout (tmoe's b = rhs^T, a = lhs^T)."""
    stored, adapters, scalings = {}, {}, set()
    for name, prefix in ((up, "w1"), ("down_proj", "w2")):
        found = _factors(experts, name)
        if found is None:
            continue
        w, lhs, rhs, scaling = found
        a, b = (lhs.transpose(1, 2), rhs.transpose(1, 2)) if transposed else (rhs, lhs)
        stored[name] = w
        adapters |= {f"{prefix}_lora_a": a, f"{prefix}_lora_b": b}
        scalings.add(scaling)
    if len(scalings) > 1:  # one lora_scale per call: read both as PEFT forms them
        return {}, {}
    return stored, ({**adapters, "lora_scale": scalings.pop()} if adapters else {})
