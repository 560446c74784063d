"""The layer ops ``tmoe::modular_forward`` (out of place) and ``tmoe::modular_forward_`` (in place).

They take the layer call (``LayerArgs``) and what the kernel is (``KernelSpec``: kinds, their int
parameters, the process group's name, the quant config, the chunk size) as primitive arguments,
and rebuild the composition from that value inside the op (cached per spec). No handle, no
registry of instances: layers with equal specs share one compiled graph, and modules copy,
pickle and save like any other. Config lookup, chunking and workspace allocation run here,
never in code that dynamo traces."""
from __future__ import annotations

import torch

from tmoe.kernels.checks import compile_visible
from tmoe.modular.call import LayerArgs, layer_schema
from tmoe.modular.checks import check_layer_call, check_no_overlap
from tmoe.modular.kernel import SPEC_SCHEMA, KernelSpec, build, split_op_args as _split
from tmoe.ops.autograd import register_layer_autograd, register_train_autograd


@torch.library.custom_op("tmoe::modular_forward", mutates_args=(),
                         schema=f"({layer_schema()}, {SPEC_SCHEMA}) -> Tensor")
def modular_forward(*args) -> torch.Tensor:
    """(M, K) layer output of the modular kernel ``spec`` on ``call``."""
    call, spec = _split(args)
    return build(spec).run(torch.empty_like(call.hidden_states), call)


@modular_forward.register_fake
@compile_visible
def _(*args):
    call, spec = _split(args)
    check_layer_call(call, spec.quant)
    spec.check_call(call)
    return torch.empty_like(call.hidden_states)


def _preact(call: LayerArgs, spec: KernelSpec) -> torch.Tensor:
    """The pre-activation's buffer (M * topk, W1's rows), after checking the call can save it."""
    if not spec.saves_preactivation:
        raise ValueError(f"tmoe::modular_forward_train saves the pre-activation of TritonExperts behind "
                         f"NoEPPrepareAndFinalize with float activations; got {spec.prepare_finalize!r} + "
                         f"{spec.experts!r}, quant {spec.quant.quant_name}")
    return call.hidden_states.new_empty((call.topk_ids.numel(), call.w1.shape[1]))


@torch.library.custom_op("tmoe::modular_forward_train", mutates_args=(),
                         schema=f"({layer_schema()}, {SPEC_SCHEMA}) -> (Tensor, Tensor)")
def modular_forward_train(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (M, K), preact (M * topk, 2N)): ``modular_forward``'s output and each slot's x @ w1[e].T,
    the pre-activation before the router weight (apply_router_weight_on_input) and the bias (row
    t * topk + j; gate columns, then up; N columns for a *_no_mul activation), which the backward
    reads instead of recomputing it (``tmoe.ops.autograd``)."""
    call, spec = _split(args)
    preact = _preact(call, spec)
    return build(spec).run(torch.empty_like(call.hidden_states), call, preact), preact


@modular_forward_train.register_fake
@compile_visible
def _(*args):
    call, spec = _split(args)
    check_layer_call(call, spec.quant)
    spec.check_call(call)
    return torch.empty_like(call.hidden_states), _preact(call, spec)


@torch.library.custom_op("tmoe::modular_forward_", mutates_args=("hidden_states",),
                         schema=f"({layer_schema(mutable_first=True)}, {SPEC_SCHEMA}) -> ()")
def modular_forward_(*args) -> None:
    """``modular_forward`` written into ``hidden_states``."""
    call, spec = _split(args)
    check_no_overlap(call.hidden_states)
    build(spec).run(call.hidden_states, call)


@modular_forward_.register_fake
@compile_visible
def _(*args):
    call, spec = _split(args)
    check_layer_call(call, spec.quant)
    spec.check_call(call)


register_layer_autograd(modular_forward)
register_train_autograd(modular_forward_train)
