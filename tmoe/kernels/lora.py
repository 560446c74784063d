"""LoRA on the experts' weights, as operands of the expert GEMMs (never W + B A).

An expert weight W[e] (C_out, C_in) with a low-rank update ``scale * B[e] @ A[e]`` (A (E, r,
C_in), B (E, C_out, r), PEFT's lora_A/lora_B per expert) multiplies rows x as

    x @ W[e].T + scale * (x @ A[e].T) @ B[e].T

The first product is the GEMM's K loop as without LoRA; ``t = x @ A[e].T`` (r values per row) is a
small GEMM of its own on the same routing, and its product with B[e] is one rank-deep dot in the
GEMM's epilogue (``_details.lora_dot``). The backward needs the same two shapes: a small GEMM for
the rows' product with one factor, and the rank-deep dot with the other in the epilogue of the
input-gradient GEMMs (``moe_grad_input``); the factors' own gradients are K-grouped GEMMs with r
rows or columns (``moe_grad_weight``).

Serving several adapters at once (vLLM's MoE-LoRA contract): the factors are stacked, A (L, E, r,
C_in) and B (L, E, C_out, r), and each token names its adapter (or -1, none). The row GEMM then
runs on virtual experts l * E + e (each slot's own adapter's A[l, e]: ``tmoe.kernels.lora_slots``), and
the epilogue adds each row's term with its adapter's B[l, e] (``_details.lora_dot``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_RANK = 128


@dataclass(frozen=True)
class LoraOperands:
    """The LoRA term of one expert GEMM's epilogue: ``scale * u[row] @ factor[e].T``.

    u: (rows, r) in the GEMM's input dtype, rank contiguous, its rows those the epilogue stores
    (slots, or aligned rows where the GEMM writes aligned rows); factor: (E, C_out, r), any strides
    (B, or a transposed view of A in the backward); scale: the adapter's scaling (alpha / r)."""

    u: torch.Tensor
    factor: torch.Tensor
    scale: float
    adapters: torch.Tensor | None = None
    """Several adapters: (rows,) int32, each row's adapter (-1: none), and factor (L, E, C_out, r)."""


def padded_rank(rank: int) -> int:
    """The dot's rank: a power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, 1 << max(rank - 1, 0).bit_length())


def lora_args(lora: LoraOperands | None, unused: torch.Tensor, batched: bool = False) -> dict:
    """The LoRA keyword arguments of ``moe_gemm``'s kernel (``LORA`` False and placeholders without one)."""
    if lora is None:
        return dict(lora_u_ptr=unused, lora_b_ptr=unused, lora_rank=0, stride_lum=0, stride_lbe=0, stride_lbn=0,
                    stride_lbr=0, lora_scale=1.0, LORA=False, LORA_R=16)
    if batched:
        raise ValueError("LoRA experts run the Standard activation format, not BatchedExperts")
    u, f = lora.u, lora.factor
    if u.stride(1) != 1:
        raise ValueError("the LoRA rows u must have their rank contiguous")
    if lora.adapters is not None:
        f = f[0]  # one adapter's (E, C_out, r): the strides within it; the adapter stride is lora_adapter_args'
    return dict(lora_u_ptr=u, lora_b_ptr=lora.factor, lora_rank=f.shape[2], stride_lum=u.stride(0),
                stride_lbe=f.stride(0), stride_lbn=f.stride(1), stride_lbr=f.stride(2), lora_scale=float(lora.scale),
                LORA=True, LORA_R=padded_rank(f.shape[2]))


def lora_adapter_args(lora: LoraOperands | None, unused: torch.Tensor) -> dict:
    """``moe_gemm``'s keyword arguments of several stacked adapters (``LORA_ADAPTERS`` False without)."""
    if lora is None or lora.adapters is None:
        return dict(lora_adapter_ptr=unused, lora_num_adapters=1, stride_lbl=0, LORA_ADAPTERS=False)
    return dict(lora_adapter_ptr=lora.adapters, lora_num_adapters=lora.factor.shape[0],
                stride_lbl=lora.factor.stride(0), LORA_ADAPTERS=True)


@dataclass(frozen=True)
class LoraWeights:
    """One expert weight's adapter as the layer call gives it: ``a`` (E, r, C_in), ``b`` (E, C_out,
    r), ``scale``; the experts run W + scale * b @ a. Several adapters: ``a`` (L, E, r, C_in), ``b``
    (L, E, C_out, r) and ``token_adapters`` (M,) each token's adapter (-1: none)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    token_adapters: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.a.shape[-2]
