"""The LoRA factors' row GEMMs as ops of the backward (``tmoe.ops.autograd``): each slot's or each
aligned row's product with one factor (``tmoe.kernels.lora_rows``)."""
from __future__ import annotations

import torch

from tmoe.kernels.checks import INDEX_DTYPES, check_tensor
from tmoe.kernels.lora_rows import lora_aligned_rows as _lora_aligned_rows, lora_token_rows as _lora_token_rows


@torch.library.custom_op("tmoe::moe_lora_token_rows", mutates_args=())
def moe_lora_token_rows(
    a: torch.Tensor, factor: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
    expert_map: torch.Tensor | None = None, num_local_experts: int | None = None,
) -> torch.Tensor:
    """(M * topk, r): each slot's a[token] @ factor[e].T (a (M, C), factor (E, r, C) any strides):
    see ``tmoe.kernels.lora_rows``."""
    _check_lora_rows(a, factor, 2)
    return _lora_token_rows(a, factor, topk_ids, num_experts, expert_map=expert_map,
                            num_local_experts=num_local_experts)


@moe_lora_token_rows.register_fake
def _(a, factor, topk_ids, num_experts, expert_map=None, num_local_experts=None):
    _check_lora_rows(a, factor, 2)
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, ndim=2)
    return a.new_empty((topk_ids.numel(), factor.shape[1]))


@torch.library.custom_op("tmoe::moe_lora_aligned_rows", mutates_args=())
def moe_lora_aligned_rows(
    d: torch.Tensor, factor: torch.Tensor, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor, block_m: int, num_slots: int,
) -> torch.Tensor:
    """(P, r): each aligned row's d[p] @ factor[e] (d (P, C), factor (E, C, r) any strides): see
    ``tmoe.kernels.lora_rows``."""
    _check_lora_rows(d, factor, 1)
    return _lora_aligned_rows(d, factor, sorted_token_ids, expert_ids, num_tokens_post_padded, block_m=block_m,
                              num_slots=num_slots)


@moe_lora_aligned_rows.register_fake
def _(d, factor, sorted_token_ids, expert_ids, num_tokens_post_padded, block_m, num_slots):
    _check_lora_rows(d, factor, 1)
    return d.new_empty((d.shape[0], factor.shape[2]))


def _check_lora_rows(a: torch.Tensor, factor: torch.Tensor, c_dim: int) -> None:
    """Rows (n, C) against a factor (E, ., .) whose dimension ``c_dim`` is C, in the rows' dtype."""
    check_tensor("a", a, ndim=2)
    check_tensor("factor", factor, dtypes=(a.dtype,), ndim=3, device=a.device)
    if factor.shape[c_dim] != a.shape[1]:
        raise ValueError(f"factor {tuple(factor.shape)} does not match rows of {a.shape[1]} columns")
