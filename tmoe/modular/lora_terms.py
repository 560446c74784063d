"""The LoRA terms of the experts' GEMMs: the adapter's rows t = a @ A[e].T (r values per row) on the
GEMM's routing, and what its epilogue reads (``tmoe.kernels.lora``)."""
from __future__ import annotations

import torch

from tmoe.kernels.lora import LoraOperands, LoraWeights
from tmoe.kernels.lora_rows import lora_aligned_rows, lora_token_rows
from tmoe.kernels.lora_slots import lora_slots
from tmoe.modular.interfaces import ExpertsCall, Route


def lora_rows(lora: LoraWeights, a: torch.Tensor, call: ExpertsCall, grouped: bool, route: dict,
              block_m: int) -> LoraOperands:
    """The LoRA term of a GEMM of rows ``a`` (``route``: its routing keywords): t = a @ lora.a[e].T,
    r values per row (``tmoe.kernels.lora_rows``), of every slot (a: token rows, ``a_row_div`` =
    topk, or slot rows), or, ``grouped`` (the grouped core's GEMM), of every expert-sorted row; with lora.b and
    lora.scale for the epilogue (``tmoe.kernels.lora``; ``block_m``: the grouped core's align block).
    The router weight is applied after the term. Stacked adapters (``lora.token_adapters``): t of
    each slot with its token's adapter, the row GEMM on virtual experts l * E_local + e
    (``lora_slots``), and each slot's adapter for the epilogue."""
    rows = route.get("routing")
    if grouped:  # expert-sorted rows in, t in the same order
        t = lora_aligned_rows(a, lora.a.transpose(1, 2), rows.sorted_token_ids, rows.expert_ids,
                              rows.num_tokens_post_padded, block_m=block_m, num_slots=rows.num_slots)
        return LoraOperands(t, lora.b, lora.scale)
    ids, e_local = call.topk_ids, call.problem.num_local_experts
    slot_rows = rows is not None and rows.a_row_div == 1  # slot rows (the intermediate): each slot its own "token"
    if lora.token_adapters is not None:
        num_adapters = lora.a.shape[0]
        vids, adapters = lora_slots(ids, lora.token_adapters, num_adapters, call.num_experts, call.expert_map,
                                    e_local)
        t = lora_token_rows(a, lora.a.flatten(0, 1), vids.reshape(-1, 1) if slot_rows else vids,
                            num_adapters * e_local, slots=call.route is Route.SLOTS)
        return LoraOperands(t, lora.b, lora.scale, adapters.reshape(-1))
    t = lora_token_rows(a, lora.a, ids.reshape(-1, 1) if slot_rows else ids, call.num_experts,
                        expert_map=call.expert_map, num_local_experts=e_local, slots=call.route is Route.SLOTS)
    return LoraOperands(t, lora.b, lora.scale)
