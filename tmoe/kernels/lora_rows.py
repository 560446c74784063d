"""The rows' products with one LoRA factor, for the backward: small M-grouped GEMMs on the
backward's align (``tmoe.kernels.lora`` says where each is read).

``lora_token_rows``: u[s] = a[token(s)] @ F[e] for every slot (F (E, r, C) any strides, a a token
tensor such as x or grad_out), rows = slots: the forward's GEMM kernel (``moe_gemm``) with N = r.
``lora_aligned_rows``: u[p] = d[p] @ F[e] for every aligned row p (d in aligned-row order, such as
grad_h or the intermediate), rows = aligned rows: the input-gradient GEMM (``sorted_input_grad``)."""
from __future__ import annotations

import torch

from tmoe.kernels.align import moe_align_block_size
from tmoe.kernels.gemm_config import GemmConfig
from tmoe.kernels.grad_config import InputTiles
from tmoe.kernels.lora import padded_rank
from tmoe.kernels.moe_gemm import invoke_moe_gemm
from tmoe.kernels.moe_grad_input import sorted_input_grad
from tmoe.kernels.operands import DirectRouting, Routing
from tmoe.kernels.route import Route

TILE_M = 16  # rows per tile of the adapters' row GEMMs (r columns, a K loop over the hidden or intermediate size)


def lora_token_rows(a: torch.Tensor, factor: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *,
                    expert_map: torch.Tensor | None = None, num_local_experts: int | None = None,
                    slots: bool = False) -> torch.Tensor:
    """(M * topk, r) in a's dtype: row s = a[s // topk] @ factor[e].T for slot s of local expert e.

    a: (M, K); factor: (E_local, r, K), a's dtype, any strides (a transposed view of B (E, K, r)
    too); topk_ids (M, topk) with ``num_experts``, ``expert_map`` and ``num_local_experts`` as the
    layer's. The slots are aligned by expert at ``TILE_M`` rows of their own: the GEMM has r columns
    and a long K loop, so its parallelism is its row blocks. Rows of slots no local expert computes
    are zero or not written (nothing reads them). ``slots`` (decode sizes, as the layer's slot
    route): no align, one row block per slot."""
    m, topk = topk_ids.shape
    out = torch.empty((m * topk, factor.shape[1]), dtype=a.dtype, device=a.device)
    cfg = GemmConfig(TILE_M, padded_rank(factor.shape[1]), 32 if a.dtype == torch.float32 else 64)
    if slots:
        invoke_moe_gemm(a, factor, out, cfg, gated=False, route=Route.SLOTS,
                        routing=DirectRouting(topk_ids, num_experts, expert_map, topk))
        return out
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids, TILE_M, num_experts, expert_map,
                                                                   num_local_experts=num_local_experts)
    invoke_moe_gemm(a, factor, out, cfg, gated=False,
                    routing=Routing(sorted_ids, expert_ids, num_post_padded, m * topk, topk))
    return out


def lora_aligned_rows(d: torch.Tensor, factor: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                      num_post_padded: torch.Tensor, *, block_m: int, num_slots: int) -> torch.Tensor:
    """(P, r) in d's dtype: row p = d[p] @ factor[e] for aligned row p of expert e.

    d: (P, C) aligned rows (padding rows zero); factor: (E, C, r), d's dtype, any strides (B as
    stored, or a transposed view of A (E, r, C)). Tiles of ``TILE_M`` rows (each inside one
    expert's aligned block)."""
    tiles = InputTiles(block_n=padded_rank(factor.shape[2]), block_r=32 if d.dtype == torch.float32 else 64,
                       num_warps=4, num_stages=3, tma=False)
    return sorted_input_grad(d, factor, sorted_ids, expert_ids, num_post_padded, num_slots, block_m=block_m,
                             tiles=tiles, tile_m=min(block_m, TILE_M))
