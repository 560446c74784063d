"""FusedMoEModularKernel: prepare -> experts -> finalize, as one custom op."""
from __future__ import annotations

import math

import torch
from torch import nn

from tmoe.checks import FLOAT_DTYPES, INDEX_DTYPES, check_shape, check_tensor
from tmoe.kernels.common import ACTIVATIONS
from tmoe.modular import (
    _HANDLES, _KERNELS, FusedMoEPermuteExpertsUnpermute, FusedMoEPrepareAndFinalize, default_chunk_size,
)


def check_moe_inputs(hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
                     apply_router_weight_on_input, w1_bias=None, w2_bias=None, quant_dtype=None, w1_scale=None,
                     w2_scale=None) -> None:
    """Shape/dtype/device checks of a layer call; raises before any launch. ``quant_dtype`` is the
    experts' (None: w1/w2 must have hidden_states' dtype; fp8: w1/w2 fp8 with their scales)."""
    check_tensor("hidden_states", hidden_states, dtypes=FLOAT_DTYPES, ndim=2)
    dev = hidden_states.device
    weight_dtype = quant_dtype or hidden_states.dtype
    why = "the quant config's dtype" if quant_dtype else "hidden_states' dtype; pass a quant_config for fp8 weights"
    for name, w, scale_name, scale in (("w1", w1, "w1_scale", w1_scale), ("w2", w2, "w2_scale", w2_scale)):
        check_tensor(name, w, ndim=3, device=dev)
        if w.dtype != weight_dtype:
            raise TypeError(f"{name} has dtype {w.dtype}, expected {weight_dtype} ({why})")
        if quant_dtype is not None and scale is None:
            raise ValueError(f"fp8 experts need {scale_name}")
    m, k = hidden_states.shape
    e, two_n, k1 = w1.shape
    if two_n % 2:
        raise ValueError(f"w1 must be (E, 2N, K) with gate rows then up rows; got {two_n} rows")
    if k1 != k:
        raise ValueError(f"w1 has K={k1} but hidden_states has K={k}")
    check_shape("w2", w2, (e, k, two_n // 2))
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, ndim=2, device=dev, contiguous=True)
    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2, device=dev, contiguous=True)
    if topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows but hidden_states has {m}")
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if apply_router_weight_on_input and topk_ids.shape[1] != 1:
        raise ValueError("apply_router_weight_on_input needs topk == 1")
    for name, bias, rows in (("w1_bias", w1_bias, two_n), ("w2_bias", w2_bias, k)):
        if bias is not None:
            check_tensor(name, bias, dtypes=FLOAT_DTYPES, ndim=2, device=dev)
            check_shape(name, bias, (e, rows))
            if bias.stride(1) != 1:
                raise ValueError(f"{name} must be contiguous along its last dimension")
    num_experts = global_num_experts if global_num_experts > 0 else e
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, device=dev, contiguous=True)
        check_shape("expert_map", expert_map, (num_experts,))
    elif num_experts != e:
        raise ValueError(f"global_num_experts={num_experts} differs from w1's {e} experts but no expert_map given")


class FusedMoEModularKernel(nn.Module):
    """``prepare_finalize`` + ``fused_experts`` as one layer call.

    forward(hidden_states (M, K), w1 (E, 2N, K), w2 (E, K, N), topk_weights (M, topk) float32,
    topk_ids (M, topk) int32/int64, ...) -> (M, K). Runs as the custom op
    ``tmoe::modular_forward``; M is split in chunks of ``chunk_size`` tokens (default
    ``TMOE_CHUNK_SIZE`` or 32768) when the experts support it, reusing one workspace.
    """

    def __init__(self, prepare_finalize: FusedMoEPrepareAndFinalize, fused_experts: FusedMoEPermuteExpertsUnpermute,
                 chunk_size: int | None = None) -> None:
        super().__init__()
        if prepare_finalize.activation_format != fused_experts.activation_formats[0]:
            raise ValueError(
                f"{type(prepare_finalize).__name__} produces {prepare_finalize.activation_format.name} activations "
                f"but {type(fused_experts).__name__} takes {fused_experts.activation_formats[0].name}"
            )
        self.prepare_finalize = prepare_finalize
        self.fused_experts = fused_experts
        self.chunk_size = chunk_size or default_chunk_size()
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        self.handle = next(_HANDLES)
        _KERNELS[self.handle] = self

    def forward(self, hidden_states, w1, w2, topk_weights, topk_ids, inplace: bool = False, activation: str = "silu",
                global_num_experts: int = -1, expert_map=None, w1_scale=None, w2_scale=None, a1_scale=None,
                a2_scale=None, apply_router_weight_on_input: bool = False, w1_bias=None,
                w2_bias=None) -> torch.Tensor:
        args = (hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
                w1_scale, w2_scale, a1_scale, a2_scale, apply_router_weight_on_input, w1_bias, w2_bias, self.handle)
        if inplace:
            torch.ops.tmoe.modular_forward_(*args)
            return hidden_states
        return torch.ops.tmoe.modular_forward(*args)

    def run(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", global_num_experts=-1,
            expert_map=None, w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None,
            apply_router_weight_on_input=False, w1_bias=None, w2_bias=None) -> torch.Tensor:
        """The eager body: writes the layer output into ``output`` (M, K) and returns it."""
        experts, pf = self.fused_experts, self.prepare_finalize
        check_moe_inputs(hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
                         apply_router_weight_on_input, w1_bias, w2_bias, experts.quant_config.quant_dtype, w1_scale,
                         w2_scale)
        if expert_map is not None and not experts.supports_expert_map():
            raise ValueError(f"{type(experts).__name__} does not support expert_map")
        m, k = hidden_states.shape
        topk = topk_ids.shape[1]
        e_local, n = w1.shape[0], w1.shape[1] // 2
        num_experts = global_num_experts if global_num_experts > 0 else e_local
        if m == 0:
            return output
        chunk = min(m, self.chunk_size) if experts.supports_chunking() else m
        ws13_shape, ws2_shape, _ = experts.workspace_shapes(hidden_states, pf.num_dispatched_tokens(chunk), n, k,
                                                            topk, num_experts, e_local)
        workspace13 = torch.empty(math.prod(ws13_shape), dtype=hidden_states.dtype, device=hidden_states.device)
        workspace2 = torch.empty(math.prod(ws2_shape), dtype=hidden_states.dtype, device=hidden_states.device)
        qc = experts.quant_config
        for start in range(0, m, chunk):
            end = min(m, start + chunk)
            x, ids, weights = hidden_states[start:end], topk_ids[start:end], topk_weights[start:end]
            s13, s2, s_out = experts.workspace_shapes(x, pf.num_dispatched_tokens(end - start), n, k, topk,
                                                      num_experts, e_local)
            ws13 = workspace13[: math.prod(s13)].view(s13)
            ws2 = workspace2[: math.prod(s2)].view(s2)
            prepared = pf.prepare(x, weights, ids, num_experts, expert_map, apply_router_weight_on_input, qc, a1_scale)
            reduced = pf.accepts_reduced_output() and experts.reduces_topk(prepared.a1q.shape[0], topk)
            fused_out = output[start:end] if reduced else ws13.view(s_out)
            expert_ids = prepared.topk_ids if prepared.topk_ids is not None else ids
            expert_weights = prepared.topk_weights if prepared.topk_weights is not None else weights
            experts.apply(fused_out, prepared.a1q, w1, w2, expert_weights, expert_ids, activation, num_experts,
                          expert_map, w1_scale, w2_scale, prepared.a1q_scale, a2_scale, ws13, ws2,
                          prepared.expert_num_tokens, apply_router_weight_on_input, w1_bias=w1_bias, w2_bias=w2_bias)
            pf.finalize(output[start:end], fused_out, weights, ids, apply_router_weight_on_input,
                        num_experts=num_experts, expert_map=expert_map, prepared=prepared)
        return output

    def warmup(self, max_tokens: int, w1: torch.Tensor, w2: torch.Tensor, topk: int, **kwargs) -> None:
        """Compile every kernel variant for 1..max_tokens tokens (powers of two and max_tokens)
        on random data, so nothing JITs during CUDA-graph capture."""
        e, k = w1.shape[0], w1.shape[2]
        dtype = kwargs.pop("dtype", torch.bfloat16)
        sizes = sorted({1 << i for i in range(max_tokens.bit_length())} | {max_tokens})
        num_experts = kwargs.get("global_num_experts", -1)
        num_experts = num_experts if num_experts > 0 else e
        for m in sizes:
            x = torch.randn(m, k, dtype=dtype, device=w1.device)
            weights, ids = torch.topk(torch.randn(m, num_experts, device=w1.device).softmax(-1), topk)
            self.forward(x, w1, w2, weights, ids.to(torch.int32), **kwargs)
