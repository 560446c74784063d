"""Pure-PyTorch references, one per stage and one for the whole layer, computed in float32
(or float64 with ``dtype=``). Readable rather than fast; the tests compare against these."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def align_reference(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Unpadded-tail form of moe_align_block_size: (sorted ids up to the padded length, expert ids
    of the used blocks, padded length)."""
    flat = topk_ids.reshape(-1).long().cpu()
    numel = flat.numel()
    ids, experts = [], []
    for e in range(num_experts):
        slots = (flat == e).nonzero().flatten().tolist()
        if not slots:
            continue
        padded = -(-len(slots) // block_size) * block_size
        ids += slots + [numel] * (padded - len(slots))
        local = e if expert_map is None else int(expert_map[e])
        experts += [local] * (padded // block_size)
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(experts, dtype=torch.int32), len(ids)


def act_and_mul_reference(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swigluoai":
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        return gate * torch.sigmoid(1.702 * gate) * (up + 1.0)
    raise ValueError(f"unknown activation {activation!r}")


def valid_slots(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """(M, topk) bool: the slot's expert is in range and (with expert_map) local."""
    ok = (topk_ids >= 0) & (topk_ids < num_experts)
    if expert_map is not None:
        ok &= expert_map.to(topk_ids.device)[topk_ids.clamp(0, num_experts - 1).long()] >= 0
    return ok


def moe_reference(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int = -1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The MoE layer: out[m] = sum_t w[m,t] * w2[e] @ act_and_mul(w1[e] @ x[m]), e = topk_ids[m,t].

    w1 (E_local, 2N, K) gate rows first; w2 (E_local, K, N). Slots of out-of-range or remote
    experts contribute zero. Returns (M, K) in ``dtype``.
    """
    num_experts = global_num_experts if global_num_experts > 0 else w1.shape[0]
    x, w1, w2 = hidden_states.to(dtype), w1.to(dtype), w2.to(dtype)
    n = w1.shape[1] // 2
    weights = topk_weights.to(dtype)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=dtype, device=x.device)
    ok = valid_slots(topk_ids, num_experts, expert_map)
    for m in range(x.shape[0]):
        for t in range(topk_ids.shape[1]):
            if not ok[m, t]:
                continue
            e = int(topk_ids[m, t])
            e = e if expert_map is None else int(expert_map[e])
            xm = x[m] * weights[m, t] if apply_router_weight_on_input else x[m]
            h = w1[e] @ xm
            y = w2[e] @ act_and_mul_reference(h[:n], h[n:], activation)
            out[m] += y if apply_router_weight_on_input else weights[m, t] * y
    return out


def topk_route_reference(
    router_logits: torch.Tensor,
    topk: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``grouped_topk`` / ``fused_topk`` with exact lowest-index-wins ties (stable sorts).

    Selection key: the logit without a bias (monotone in the score), ``score + bias`` with one;
    NaN logits read as -inf. Returns (M, topk) float32 weights and int32 ids in pick order.
    """
    x = router_logits.to(dtype)
    x = x.masked_fill(x.isnan(), float("-inf"))
    scores = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    bias = e_score_correction_bias
    key = x if bias is None else scores + bias.to(dtype)
    if num_expert_group:
        m, e = key.shape
        groups = key.view(m, num_expert_group, e // num_expert_group)
        if bias is None:
            group_scores = groups.max(dim=-1).values
        else:
            group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)
        kept = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, :topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        key = key.masked_fill(~keep[:, :, None].expand_as(groups).reshape(m, e), float("-inf"))
    ids = key.sort(dim=-1, descending=True, stable=True).indices[:, :topk]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * routed_scaling_factor).float(), ids.int()
