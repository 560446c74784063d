"""Each slot's adapter when several LoRA adapters are served at once: one launch that reads the
routing and the tokens' adapters and writes what the adapters' GEMMs read (``tmoe.kernels.lora``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tmoe.kernels._details.common import local_expert
from tmoe.kernels.checks import INDEX_DTYPES, check_shape, check_tensor
from tmoe.kernels.sizes import cdiv, check_num_local_experts
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from tmoe.runtime.plan import Launch, planned

BLOCK = 1024  # slots per program


@triton.jit
def _lora_slots_kernel(
    topk_ids_ptr,  # [num_slots] int32/int64
    token_adapters_ptr,  # [M] int32/int64, -1 for none
    expert_map_ptr,  # [num_experts] int32 (HAS_MAP)
    virtual_ptr,  # [num_slots] int32 out: adapter * E_local + local expert, -1 for none
    adapters_ptr,  # [num_slots] int32 out: the slot's adapter, -1 for none
    num_slots, topk, num_experts, num_local_experts, num_adapters,
    HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    slots = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = slots < num_slots
    expert = local_expert(topk_ids_ptr, expert_map_ptr, slots, num_experts, num_local_experts, HAS_MAP, mask)
    adapter = tl.load(token_adapters_ptr + slots // topk, mask=mask, other=-1).to(tl.int64)
    adapter = tl.where((adapter >= 0) & (adapter < num_adapters), adapter, -1)
    virtual = tl.where((expert >= 0) & (adapter >= 0), adapter * num_local_experts + expert, -1)
    pdl_launch_dependents(USE_PDL)
    tl.store(virtual_ptr + slots, virtual.to(tl.int32), mask=mask)
    tl.store(adapters_ptr + slots, adapter.to(tl.int32), mask=mask)


def lora_slots(topk_ids: torch.Tensor, token_adapters: torch.Tensor, num_adapters: int, num_experts: int,
               expert_map: torch.Tensor | None = None, num_local_experts: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(virtual, adapters), each (M, topk) int32: slot (m, t)'s virtual expert l * E_local + e (e
    its local expert, l = token_adapters[m]) and its adapter l; virtual is -1 where the token has
    no adapter (l outside [0, num_adapters): the base alone, as an out-of-range expert id adds
    nothing) or the expert is not local, adapters is -1 where the token has none.

    The adapters' row GEMM aligns on ``virtual`` over A (L, E_local, r, C) viewed as (L * E_local,
    r, C), so each slot multiplies its own adapter's factor; the GEMM epilogues read ``adapters``.
    topk_ids (M, topk) int32/int64 contiguous, ids outside [0, num_experts) count as not local;
    token_adapters (M,) int32/int64; expert_map (num_experts,) int32 global -> local or -1."""
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, ndim=2, contiguous=True)
    virtual = torch.empty(topk_ids.shape, dtype=torch.int32, device=topk_ids.device)
    adapters = torch.empty(topk_ids.shape, dtype=torch.int32, device=topk_ids.device)
    _lora_slots_into(topk_ids, token_adapters, num_adapters, num_experts, expert_map, virtual, adapters,
                     num_local_experts=num_local_experts)
    return virtual, adapters


@with_interpreter_fixes
@planned
def _lora_slots_into(topk_ids: torch.Tensor, token_adapters: torch.Tensor, num_adapters: int, num_experts: int,
                     expert_map: torch.Tensor | None, virtual: torch.Tensor, adapters: torch.Tensor, *,
                     num_local_experts: int | None) -> Launch | torch.Tensor:
    """``lora_slots`` into its outputs: checks, then the launch (planned: once per signature)."""
    m, topk = topk_ids.shape
    check_tensor("token_adapters", token_adapters, dtypes=INDEX_DTYPES, ndim=1, device=topk_ids.device,
                 contiguous=True)
    check_shape("token_adapters", token_adapters, (m,))
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, device=topk_ids.device,
                     contiguous=True)
        check_shape("expert_map", expert_map, (num_experts,))
    num_local_experts = check_num_local_experts(num_local_experts, expert_map, num_experts)
    if m * topk == 0:
        return virtual
    return Launch(_lora_slots_kernel, (cdiv(m * topk, BLOCK),), dict(
        topk_ids_ptr=topk_ids, token_adapters_ptr=token_adapters,
        expert_map_ptr=expert_map if expert_map is not None else topk_ids, virtual_ptr=virtual,
        adapters_ptr=adapters, num_slots=m * topk, topk=topk, num_experts=num_experts,
        num_local_experts=num_local_experts, num_adapters=num_adapters, HAS_MAP=expert_map is not None, BLOCK=BLOCK,
        num_warps=4, **pdl_args(),
    ), virtual)
