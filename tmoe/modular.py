"""The modular MoE kernel: a PrepareAndFinalize (quantize, dispatch; combine) composed with a
PermuteExpertsUnpermute (align, GEMMs), so communication schemes and expert kernels plug in
independently.

``FusedMoEModularKernel.forward`` is one custom op (``tmoe::modular_forward``) that looks the
kernel up by handle, so config lookup, chunking and workspace allocation run eagerly inside
the op and never in code that dynamo traces.
"""
from __future__ import annotations

import itertools
import os
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tmoe.modular_kernel import FusedMoEModularKernel


class FusedMoEActivationFormat(Enum):
    Standard = "standard"  # (num_tokens, K)
    BatchedExperts = "batched_experts"  # (local_experts, max_tokens_per_expert, K)


@dataclass(frozen=True)
class FusedMoEQuantConfig:
    """How activations and weights are quantized. ``quant_dtype=None``: no quantization.
    fp8: per-tensor by default; ``per_act_token_quant`` (one activation scale per token),
    ``per_out_ch_quant`` (one weight scale per output channel), or ``block_shape=[bn, bk]``
    (activation groups of bk along K, weight blocks bn x bk)."""

    quant_dtype: torch.dtype | None = None
    per_act_token_quant: bool = False
    per_out_ch_quant: bool = False
    block_shape: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.block_shape is not None:
            object.__setattr__(self, "block_shape", tuple(int(b) for b in self.block_shape))
            if len(self.block_shape) != 2:
                raise ValueError(f"block_shape must be [block_n, block_k], got {self.block_shape}")
        if self.quant_dtype not in (None, torch.float8_e4m3fn):
            raise ValueError(f"quant_dtype must be None or torch.float8_e4m3fn, got {self.quant_dtype}")
        if self.quant_dtype is None and (self.per_act_token_quant or self.per_out_ch_quant or self.block_shape):
            raise ValueError("per-token, per-channel and block options need quant_dtype=torch.float8_e4m3fn")
        if self.block_shape is not None and (self.per_act_token_quant or self.per_out_ch_quant):
            raise ValueError("block_shape excludes per_act_token_quant and per_out_ch_quant")

    @property
    def scheme(self) -> str:
        """"none", "tensor", "token" (per-token activations) or "block"."""
        if self.quant_dtype is None:
            return "none"
        if self.block_shape is not None:
            return "block"
        return "token" if self.per_act_token_quant else "tensor"

    def as_args(self) -> tuple[str | None, bool, bool, list[int] | None]:
        """Primitive form for custom-op arguments."""
        dtype = None if self.quant_dtype is None else str(self.quant_dtype).removeprefix("torch.")
        return dtype, self.per_act_token_quant, self.per_out_ch_quant, list(self.block_shape) if self.block_shape else None

    @classmethod
    def from_args(cls, dtype: str | None, per_act_token: bool, per_out_ch: bool, block_shape: list[int] | None):
        return cls(getattr(torch, dtype) if dtype else None, per_act_token, per_out_ch,
                   tuple(block_shape) if block_shape else None)


@dataclass(frozen=True)
class PrepareResult:
    """What prepare hands to the experts. Standard: ``a1q`` (M', K); Batched: (E, cap, K) with
    ``expert_num_tokens`` (E,) int32 and ``dispatch_rows`` (M, topk) int32 (row of each slot in
    the batch view (E*cap, K), -1 if dropped or remote). Scales are None when unquantized.
    ``topk_ids``/``topk_weights`` (M', topk): the dispatched routing when prepare gathered tokens
    from other ranks (M' != M); None means the caller's."""

    a1q: torch.Tensor
    a1q_scale: torch.Tensor | None = None
    expert_num_tokens: torch.Tensor | None = None
    dispatch_rows: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None


class FusedMoEPrepareAndFinalize(ABC):
    """Quantize and dispatch tokens before the experts; apply router weights and reduce after."""

    @property
    @abstractmethod
    def activation_format(self) -> FusedMoEActivationFormat: ...

    @abstractmethod
    def prepare(
        self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
        expert_map: torch.Tensor | None, apply_router_weight_on_input: bool, quant_config: FusedMoEQuantConfig,
        a1_scale: torch.Tensor | None = None,
    ) -> PrepareResult: ...

    @abstractmethod
    def finalize(
        self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor, apply_router_weight_on_input: bool, *, num_experts: int,
        expert_map: torch.Tensor | None, prepared: PrepareResult,
    ) -> None:
        """Write sum_t w[m, t] * expert_output(m, t) into ``output`` (M, K) in place.
        ``fused_expert_output`` is (M', topk, K) per slot, or (M', K) already summed."""

    def accepts_reduced_output(self) -> bool:
        """Whether finalize takes the experts' weighted top-k sum (M, K) in place of per-slot
        outputs, so that experts which reduce (``reduces_topk``) write the layer output."""
        return False

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None

    def num_dispatched_tokens(self, num_tokens: int) -> int:
        """Tokens the experts see for ``num_tokens`` local ones (more when prepare gathers from
        other ranks): sizes the workspaces."""
        return num_tokens

    def max_num_tokens_per_rank(self) -> int | None:
        return None


class FusedMoEPermuteExpertsUnpermute(ABC):
    """Run the experts on prepared activations; no top-k weighting and no reduction."""

    def __init__(self, quant_config: FusedMoEQuantConfig | None = None) -> None:
        self.quant_config = quant_config or FusedMoEQuantConfig()

    @property
    @abstractmethod
    def activation_formats(self) -> tuple[FusedMoEActivationFormat, FusedMoEActivationFormat]: ...

    def supports_chunking(self) -> bool:
        return False

    def supports_expert_map(self) -> bool:
        return False

    def reduces_topk(self, m: int, topk: int) -> bool:
        """Whether apply() at ``m`` tokens can write the weighted top-k sum itself: it is then
        handed an (M, K) ``output`` (when the PrepareAndFinalize accepts reduced output)."""
        return False

    @abstractmethod
    def workspace_shapes(
        self, a: torch.Tensor, m: int, n: int, k: int, topk: int, num_experts: int, local_num_experts: int,
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(workspace13, workspace2, fused output) shapes from static sizes: workspace13 holds
        the down-GEMM output (the fused output is a view of it), workspace2 the activation."""

    @abstractmethod
    def apply(
        self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
        topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str, global_num_experts: int,
        expert_map: torch.Tensor | None, w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
        a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None, workspace13: torch.Tensor,
        workspace2: torch.Tensor, expert_num_tokens: torch.Tensor | None, apply_router_weight_on_input: bool,
        w1_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
    ) -> None:
        """Expert outputs into ``output``; ``w1_bias`` (E, 2N) / ``w2_bias`` (E, K) are optional
        per-expert biases (GPT-OSS)."""


_KERNELS: weakref.WeakValueDictionary[int, FusedMoEModularKernel] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def default_chunk_size() -> int:
    return int(os.environ.get("TMOE_CHUNK_SIZE", "32768"))


def kernel_for_handle(handle: int) -> FusedMoEModularKernel:
    return _KERNELS[handle]
