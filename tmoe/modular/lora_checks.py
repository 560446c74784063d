"""Checks of a layer call's LoRA adapters (``LayerArgs.w1_lora_a`` ... ``lora_scale``), raised
before any launch and naming the argument; shapes only, so the op's fake runs them too."""
from __future__ import annotations

import math

import torch

from tmoe.kernels.checks import INDEX_DTYPES, check_shape, check_tensor
from tmoe.kernels.lora import MAX_RANK, LoraWeights
from tmoe.modular.call import LayerArgs

LORA_TENSORS = ("w1_lora_a", "w1_lora_b", "w2_lora_a", "w2_lora_b")


def has_lora(args: LayerArgs) -> bool:
    return any(getattr(args, name) is not None for name in LORA_TENSORS)


def check_lora(args: LayerArgs, e: int, w1_rows: int, n: int) -> tuple[tuple[int, int], int]:
    """The adapters' ranks (r1, r2; 0: no adapter on that weight) and, with ``lora_ids``, the
    stacked adapters' count L (else 0), after checking them: each pair given together (on float,
    fp8 or low-bit experts: the adapters stay in hidden_states' dtype), hidden_states' dtype and
    device, w1's pair (E, r1, K) and (E, 2N, r1) (w1's rows), w2's (E, r2, N) and (E, K, r2), with
    ``lora_ids`` (M,) int32/int64 contiguous each stacked (L, ...) with one L, 1 <= r <= 128; ``lora_scale``
    a finite float, only with an adapter."""
    x = args.hidden_states
    k = x.shape[1]
    ids = args.lora_ids
    stacked = () if ids is None else (None,)  # the adapters' leading dimension L, taken from the first pair
    ranks = []
    for w, shapes in (("w1", ((e, None, k), (e, w1_rows, None))), ("w2", ((e, None, n), (e, k, None)))):
        a, b = getattr(args, f"{w}_lora_a"), getattr(args, f"{w}_lora_b")
        if a is None and b is None:
            ranks.append(0)
            continue
        if a is None or b is None:
            missing = f"{w}_lora_a" if a is None else f"{w}_lora_b"
            raise ValueError(f"{missing} is missing: a LoRA adapter on {w} needs both {w}_lora_a and {w}_lora_b")
        for name, t in ((f"{w}_lora_a", a), (f"{w}_lora_b", b)):
            if ids is None and t.ndim == 4:
                raise ValueError(f"{name} is 4-D, stacked adapters (L, E, ...): give lora_ids, each token's adapter")
            if ids is not None and t.ndim != 4:
                raise ValueError(f"{name} must be stacked adapters (L, E, ...) (4-D) with lora_ids; got shape "
                                 f"{tuple(t.shape)}")
            check_tensor(name, t, dtypes=(x.dtype,), ndim=3 + len(stacked), device=x.device)
        if stacked and stacked[0] is None:
            stacked = (a.shape[0],)
        rank = a.shape[-2]
        if not 1 <= rank <= MAX_RANK:
            raise ValueError(f"{w}_lora_a must be ({'L, ' if stacked else ''}E, r, C) with 1 <= r <= {MAX_RANK}; "
                             f"got r={rank}")
        (ea, _, ca), (eb, rb, _) = shapes
        check_shape(f"{w}_lora_a", a, (*stacked, ea, rank, ca))
        check_shape(f"{w}_lora_b", b, (*stacked, eb, rb, rank))
        ranks.append(rank)
    if ids is not None:
        if not any(ranks):
            raise ValueError("lora_ids was given without an adapter (w1_lora_a/b or w2_lora_a/b)")
        check_tensor("lora_ids", ids, dtypes=INDEX_DTYPES, ndim=1, device=x.device, contiguous=True)
        check_shape("lora_ids", ids, (x.shape[0],))
        if stacked[0] < 1:
            raise ValueError("the stacked adapters (w1_lora_a ...) must hold at least one adapter (L >= 1)")
    if args.lora_scale is not None:
        if not any(ranks):
            raise ValueError("lora_scale was given without an adapter (w1_lora_a/b or w2_lora_a/b)")
        v = args.lora_scale
        if isinstance(v, bool) or not isinstance(v, (int, float, torch.SymFloat, torch.SymInt)) or (
                isinstance(v, (int, float)) and not math.isfinite(v)):
            raise ValueError(f"lora_scale must be a finite float, got {v!r}")
    return (ranks[0], ranks[1]), (stacked[0] if stacked else 0)


def lora_weights(args: LayerArgs, weight: str, lora_ids: torch.Tensor | None = None) -> LoraWeights | None:
    """``weight``'s ("w1" or "w2") adapter of a checked call, or None; ``lora_ids``: the call's
    (or its chunk's) token adapters, with stacked adapters."""
    a = getattr(args, f"{weight}_lora_a")
    if a is None:
        return None
    scale = 1.0 if args.lora_scale is None else float(args.lora_scale)
    return LoraWeights(a, getattr(args, f"{weight}_lora_b"), scale, lora_ids)
