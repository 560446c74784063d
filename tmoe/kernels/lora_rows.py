"""The rows' products with one LoRA factor, for the backward: small M-grouped GEMMs on the
backward's align (``tmoe.kernels.lora`` says where each is read).

``lora_token_rows``: u[s] = a[token(s)] @ F[e] for every slot (F (E, r, C) any strides, a a token
tensor such as x or grad_out), rows = slots: the forward's up GEMM kernel (``moe_gemm``) with N = r.
``lora_aligned_rows``: u[p] = d[p] @ F[e] for every aligned row p (d in aligned-row order, such as
grad_h or the intermediate), rows = aligned rows: the input-gradient GEMM (``sorted_input_grad``)."""
from __future__ import annotations

import torch

from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels.grad_config import InputTiles
from tmoe.kernels.lora import padded_rank
from tmoe.kernels.moe_gemm import invoke_moe_gemm
from tmoe.kernels.moe_grad_input import sorted_input_grad
from tmoe.kernels.operands import Routing


def lora_token_rows(a: torch.Tensor, factor: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                    num_post_padded: torch.Tensor, *, block_m: int, topk: int) -> torch.Tensor:
    """(M * topk, r) in a's dtype: row s = a[s // topk] @ factor[e].T for slot s of local expert e.

    a: (M, K); factor: (E, r, K), a's dtype, any strides (a transposed view of B (E, K, r) too);
    sorted_ids, expert_ids, num_post_padded: ``moe_align_block_size`` of the slots at ``block_m``.
    Rows of slots no local expert computes are zero or not written (nothing reads them)."""
    m = a.shape[0]
    out = torch.empty((m * topk, factor.shape[1]), dtype=a.dtype, device=a.device)
    cfg = GemmConfig(block_m, padded_rank(factor.shape[1]), 32 if a.dtype == torch.float32 else 64)
    invoke_moe_gemm(a, factor, out, cfg, gated=False,
                    routing=Routing(sorted_ids, expert_ids, num_post_padded, m * topk, topk))
    return out


def lora_aligned_rows(d: torch.Tensor, factor: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                      num_post_padded: torch.Tensor, *, block_m: int, num_slots: int) -> torch.Tensor:
    """(P, r) in d's dtype: row p = d[p] @ factor[e] for aligned row p of expert e.

    d: (P, C) aligned rows (padding rows zero); factor: (E, C, r), d's dtype, any strides (B as
    stored, or a transposed view of A (E, r, C))."""
    tiles = InputTiles(block_n=padded_rank(factor.shape[2]), block_r=32 if d.dtype == torch.float32 else 64,
                       num_warps=4, num_stages=3, tma=False)
    return sorted_input_grad(d, factor, sorted_ids, expert_ids, num_post_padded, num_slots, block_m=block_m,
                             tiles=tiles)
