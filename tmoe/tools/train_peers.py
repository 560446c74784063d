"""The layers ``python -m tmoe bench-train`` steps: tmoe's (saving or recomputing the
pre-activation), transformers' ``torch._grouped_mm`` experts path in plain autograd and
Liger-Kernel's ``LigerFusedMoEFunction``, each a function of (x, w1, w2, topk_weights) for fixed
routing, and the forward+backward step that times them."""
from __future__ import annotations

import argparse
import os
from typing import Callable

import torch

from tmoe.tools import peers

Layer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def tmoe_layer(ids: torch.Tensor, save_preactivation: bool = True) -> Layer:
    """tmoe's layer; ``save_preactivation`` False: the backward recomputes the pre-activation
    (the "tmoe_recompute" provider)."""
    import tmoe

    return lambda x, w1, w2, tw: tmoe.fused_experts(x, w1, w2, tw, ids, save_preactivation=save_preactivation)


def grouped_mm_layer(ids: torch.Tensor) -> Layer:
    """transformers' grouped_mm experts path (``peers.grouped_mm_moe``) on transposed views, as
    transformers passes them; a contiguous copy inside the step if ``_grouped_mm`` refuses views."""
    views = peers.grouped_mm_takes_views(ids.device)

    def t(w: torch.Tensor) -> torch.Tensor:
        return w.transpose(1, 2) if views else w.transpose(1, 2).contiguous()

    return lambda x, w1, w2, tw: peers.grouped_mm_moe(x, t(w1), t(w2), tw, ids)


def liger_layer(ids: torch.Tensor, autotune: bool) -> Layer:
    """Liger-Kernel's ``LigerFusedMoEFunction.apply(x, gate_up_proj (E, 2I, H), down_proj (E, H, I),
    top_k_index int32, top_k_weights)``: tmoe's w1/w2 layout (gate rows first), silu."""
    if not autotune:
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")  # read when liger_kernel is first imported
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    ids32 = ids.to(torch.int32).contiguous()
    return lambda x, w1, w2, tw: LigerFusedMoEFunction.apply(x, w1, w2, ids32, tw)


def provider_name(name: str, args: argparse.Namespace) -> str:
    return "liger" if name == "liger" and args.liger_autotune else ("liger[pinned]" if name == "liger" else name)


def make_layer(name: str, ids: torch.Tensor, args: argparse.Namespace) -> Layer:
    if name in ("tmoe", "tmoe_recompute"):
        return tmoe_layer(ids, save_preactivation=name == "tmoe")
    if name == "grouped_mm":
        return grouped_mm_layer(ids)
    if ids.device.type != "cuda":
        raise RuntimeError("skipped: Liger's kernels need a CUDA device")
    return liger_layer(ids, args.liger_autotune)


def step_fn(layer: Layer, params: tuple[torch.Tensor, ...], grad_out: torch.Tensor) -> Callable[[], tuple]:
    """One fwd+bwd step -> (out, dx, dw1, dw2, dtopk_weights)."""
    def step() -> tuple:
        out = layer(*params)
        return (out.detach(), *torch.autograd.grad(out, params, grad_out))
    return step
