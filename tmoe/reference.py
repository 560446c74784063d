"""Pure-PyTorch references, one per stage and one for the whole layer, computed in float32
(or float64 with ``dtype=``). Readable rather than fast; the tests compare against these."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def align_reference(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_map: torch.Tensor | None = None,
    num_local_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Unpadded-tail form of moe_align_block_size: (sorted ids up to the padded length, expert ids
    of the used blocks, padded length). Mapped ids outside [0, num_local_experts) read -1."""
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
        if num_local_experts is not None and not 0 <= local < num_local_experts:
            local = -1
        experts += [local] * (padded // block_size)
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(experts, dtype=torch.int32), len(ids)


def act_and_mul_reference(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float | None = None,
                          limit: float | None = None) -> torch.Tensor:
    """act(gate) * up; swigluoai with ``alpha`` (None: 1.702) and ``limit`` (None: 7.0); silu with
    a ``limit``: min(silu(gate), limit) * clamp(up, -limit, limit)."""
    if activation == "silu":
        if limit is None:
            return F.silu(gate) * up
        return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
    if activation == "gelu":
        return F.gelu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swigluoai":
        alpha, limit = 1.702 if alpha is None else alpha, 7.0 if limit is None else limit
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return gate * torch.sigmoid(alpha * gate) * (up + 1.0)
    raise ValueError(f"unknown activation {activation!r}")


def activation_reference(h: torch.Tensor, activation: str, alpha: float | None = None, limit: float | None = None,
                         interleaved: bool = False) -> torch.Tensor:
    """The intermediate from the up projection h (rows, N_w): act(h) (rows, N) for a *_no_mul
    activation, else act_and_mul of its gate and up halves (``interleaved``: even and odd columns)."""
    if activation == "silu_no_mul":
        return F.silu(h)
    if activation == "gelu_no_mul":
        return F.gelu(h)
    if activation == "relu2_no_mul":
        return F.relu(h).square()
    n = h.shape[-1] // 2
    gate, up = (h[..., 0::2], h[..., 1::2]) if interleaved else (h[..., :n], h[..., n:])
    return act_and_mul_reference(gate, up, activation, alpha, limit)


def valid_slots(
    topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None = None,
    num_local_experts: int | None = None,
) -> torch.Tensor:
    """(M, topk) bool: the slot's expert is in range and (with expert_map) local, its local id
    in [0, num_local_experts) when that is given."""
    ok = (topk_ids >= 0) & (topk_ids < num_experts)
    if expert_map is not None:
        local = expert_map.to(topk_ids.device)[topk_ids.clamp(0, num_experts - 1).long()]
        ok &= local >= 0
        if num_local_experts is not None:
            ok &= local < num_local_experts
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
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
    gate_up_interleaved: bool = False,
) -> torch.Tensor:
    """The MoE layer: out[m] = sum_t w[m,t] * (w2[e] @ act_and_mul(w1[e] @ x[m] + b1[e]) + b2[e]),
    e = topk_ids[m,t].

    w1 (E_local, 2N, K) gate rows first (``gate_up_interleaved``: alternating; a *_no_mul
    activation: (E_local, N, K)); w2 (E_local, K, N); optional biases b1 (E_local, 2N) in w1's
    row order, b2 (E_local, K). Slots of out-of-range or remote experts contribute zero, as do those that
    expert_map sends outside [0, E_local). Computed expert by expert in ``dtype``; returns (M, K).
    """
    num_experts = global_num_experts if global_num_experts > 0 else w1.shape[0]
    x = hidden_states.to(dtype)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=dtype, device=x.device)
    for e in range(num_experts):
        local = e if expert_map is None else int(expert_map[e])
        rows, cols = (topk_ids == e).nonzero(as_tuple=True)
        if not 0 <= local < w1.shape[0] or rows.numel() == 0:
            continue
        weight = topk_weights[rows, cols].to(dtype).unsqueeze(1)
        xe = x[rows] * weight if apply_router_weight_on_input else x[rows]
        h = xe @ w1[local].to(dtype).T
        if w1_bias is not None:
            h = h + w1_bias[local].to(dtype)
        y = activation_reference(h, activation, swiglu_alpha, swiglu_limit, gate_up_interleaved) @ w2[local].to(dtype).T
        if w2_bias is not None:
            y = y + w2_bias[local].to(dtype)
        out.index_add_(0, rows, y if apply_router_weight_on_input else y * weight)
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


# FP8 (e4m3fn) quantization: q = clamp(x / scale, ±448) in float32, cast rounding to nearest even.
# Quotients are taken in float64 and rounded to float32, which is exactly IEEE float32 division
# (53 >= 2 * 24 + 2 bits) on every device; the kernels divide that way too (tl.div_rn). Torch's
# CUDA division by a Python scalar multiplies by the reciprocal instead, 1 ulp off at times.
FP8_MAX = 448.0


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b for float32 tensors (b on a's device), correctly rounded to float32."""
    return (a.double() / b.double()).float()


def fp8_scale_reference(absmax: torch.Tensor, eps: float, use_ue8m0: bool = False) -> torch.Tensor:
    """max(absmax, eps) / 448; ``use_ue8m0``: rounded up to the next power of two."""
    scale = _div(absmax.float().clamp(min=eps), absmax.new_full((), FP8_MAX, dtype=torch.float32))
    if use_ue8m0:
        mantissa, _ = torch.frexp(scale)  # scale = mantissa * 2**e, mantissa in [0.5, 1)
        scale = torch.where((mantissa == 0.5) | scale.isinf(), scale, _div(scale, mantissa))  # 2**e, exactly
    return scale


def fp8_cast_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """clamp(x / scale, ±448) as float8_e4m3fn (torch.clamp keeps NaN)."""
    return _div(x.float(), scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _absmax_ignoring_nan(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.isnan(), 0.0, x.abs()).amax(dim=-1, keepdim=True)


def per_token_group_quant_fp8_reference(
    x: torch.Tensor, group_size: int, eps: float = 1e-10, use_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) -> (q (..., K) float8_e4m3fn, scales (..., K // group_size) float32)."""
    groups = x.float().unflatten(-1, (-1, group_size))  # [..., G, group_size]
    scale = fp8_scale_reference(_absmax_ignoring_nan(groups), eps, use_ue8m0)  # [..., G, 1]
    return fp8_cast_reference(groups, scale).flatten(-2), scale.squeeze(-1)


def per_token_quant_fp8_reference(x: torch.Tensor, eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K), K > 0 -> (q (..., K) float8_e4m3fn, scales (..., 1) float32)."""
    scale = fp8_scale_reference(_absmax_ignoring_nan(x.float()), eps)
    return fp8_cast_reference(x, scale), scale


def static_quant_fp8_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., K), one-element float32 scale -> (..., K) float8_e4m3fn."""
    return fp8_cast_reference(x, scale.float().reshape(()))


def dequantize_fp8_reference(
    q: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    """float32 q * scale. Each scale covers a ``block_shape`` block of q's trailing dims (ragged
    edge blocks included), e.g. (group_size,) for group scales, (128, 128) for block weights;
    None broadcasts ``scale`` as is (per-token (..., 1), per-channel (E, N, 1))."""
    s = scale.float()
    if block_shape is not None:
        for dim, block in enumerate(block_shape, start=q.dim() - len(block_shape)):
            s = s.repeat_interleave(block, dim=dim).narrow(dim, 0, q.shape[dim])
    return q.float() * s


# Weight-only low-bit layouts (vLLM's fused_moe_kernel_gptq_awq; OCP mxfp4 as GPT-OSS ships it).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def pack_int4_reference(q: torch.Tensor) -> torch.Tensor:
    """(..., 2J) codes in [0, 16) -> (..., J) uint8: element 2j in the low nibble, 2j + 1 in the high."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4_reference(packed: torch.Tensor) -> torch.Tensor:
    """(..., J) uint8 -> (..., 2J) uint8 codes; inverse of ``pack_int4_reference``."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _per_group(s: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """(..., cdiv(k, g)) -> (..., k): each group's value repeated over its (last: ragged) group."""
    return s.repeat_interleave(group_size, dim=-1)[..., :k]


def dequantize_int_reference(
    w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, group_size: int, bits: int
) -> torch.Tensor:
    """float32 (E, rows, K) = (q - zp) * scale of int4 (``bits`` 4: w (E, rows, K / 2), zero points
    (E, rows / 2, groups) two rows per byte) or int8 (w (E, rows, K), zero points (E, rows, groups))
    weights; scales (E, rows, groups), groups = cdiv(K, group_size); no zero points: 8 or 128."""
    q = (unpack_int4_reference(w) if bits == 4 else w).int()
    if zero_point is None:
        zp = torch.full_like(scale, 1 << (bits - 1), dtype=torch.int32)
    elif bits == 4:
        zp = unpack_int4_reference(zero_point.transpose(1, 2)).transpose(1, 2).int()
    else:
        zp = zero_point.int()
    k = q.shape[-1]
    return (q - _per_group(zp, group_size, k)).float() * _per_group(scale.float(), group_size, k)


def dequantize_mxfp4_reference(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 (E, rows, K) = e2m1(q) * 2^(s - 127): w (E, rows, K / 2) uint8 two e2m1 codes per
    byte (even k low), scale (E, rows, cdiv(K, 32)) uint8 e8m0."""
    values = torch.tensor(E2M1_VALUES, device=w.device)[unpack_int4_reference(w).long()]
    exponent = _per_group(scale.int() - 127, 32, values.shape[-1])
    return torch.ldexp(values, exponent.float())
