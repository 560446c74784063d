"""The two interfaces of the modular MoE kernel: a PrepareAndFinalize (quantize, dispatch;
combine) and a PermuteExpertsUnpermute (align, GEMMs), so communication schemes and expert
kernels plug in independently.

Both are values: a subclass names itself with a ``kind`` and says which primitive arguments
rebuild it (``op_args``), so the layer op receives what the kernel *is* (strings and ints),
never a handle to a Python object. Subclasses with a ``kind`` register themselves.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, NamedTuple

import torch

from tmoe.kernels.activation import Activation
from tmoe.kernels.lora import LoraWeights
from tmoe.kernels.route import Route
from tmoe.modular.call import LayerArgs
from tmoe.modular.problem import MoEProblem
from tmoe.modular.quant_config import FusedMoEQuantConfig


class FusedMoEActivationFormat(Enum):
    Standard = "standard"  # (num_tokens, K)
    BatchedExperts = "batched_experts"  # (local_experts, max_tokens_per_expert, K)


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


class ExpertsCall(NamedTuple):
    """One chunk's experts call: what the call plan decided (the route and the ``MoEProblem``: the
    intermediate size, the expert counts, the activation), the prepared activations and the layer's
    weights.

    ``hidden_states``: the prepared (M', K) (Standard) or (E_local, capacity, K) (Batched)
    activations, with ``a1q_scale`` when quantized and ``expert_num_tokens`` (E_local,) int32
    when batched; ``topk_weights``/``topk_ids`` (M', topk) the dispatched routing; the rest are
    ``tmoe.modular.LayerArgs``'s (``w1`` is (E, N, K) for a *_no_mul activation; ``w1_zp``/
    ``w2_zp`` zero points of int4/int8 weights); ``preact`` (M' * topk, 2N) (N for a *_no_mul
    activation): where training's forward saves each slot's pre-activation (``TritonExperts``'
    aligned routes), else None; ``w1_lora``/``w2_lora``: the call's adapters (``LoraWeights``), else None;
    ``lora_rows``: with an adapter on w1, the rows before quantization (fp8 activations), which
    its t = x @ A[e].T reads, else None."""

    route: Route
    problem: MoEProblem
    hidden_states: torch.Tensor
    a1q_scale: torch.Tensor | None
    expert_num_tokens: torch.Tensor | None
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    expert_map: torch.Tensor | None
    w1_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    a2_scale: torch.Tensor | None
    w1_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    w1_zp: torch.Tensor | None
    w2_zp: torch.Tensor | None
    apply_router_weight_on_input: bool
    preact: torch.Tensor | None = None
    w1_lora: LoraWeights | None = None
    w2_lora: LoraWeights | None = None
    lora_rows: torch.Tensor | None = None

    @property
    def n(self) -> int:
        """The intermediate size."""
        return self.problem.n

    @property
    def num_experts(self) -> int:
        """The global expert count (topk_ids' range)."""
        return self.problem.num_experts

    @property
    def activation(self) -> Activation:
        return self.problem.activation


PREPARE_FINALIZE_KINDS: dict[str, type[FusedMoEPrepareAndFinalize]] = {}
EXPERTS_KINDS: dict[str, type[FusedMoEPermuteExpertsUnpermute]] = {}


class FusedMoEPrepareAndFinalize(ABC):
    """Quantize and dispatch tokens before the experts; apply router weights and reduce after.

    By value: ``kind`` names the class; ``cls.from_op_args(self.op_args(), self.group_name())``
    rebuilds an equal instance (defaults: no parameters, no process group)."""

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("kind"):
            PREPARE_FINALIZE_KINDS[cls.kind] = cls

    def op_args(self) -> tuple[int, ...]:
        return ()

    def group_name(self) -> str:
        """The process group's name (``torch.distributed``), "" when there is none."""
        return ""

    @classmethod
    def from_op_args(cls, args: tuple[int, ...], group_name: str) -> FusedMoEPrepareAndFinalize:
        return cls(*args)

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
        expert_map: torch.Tensor | None, prepared: PrepareResult, num_local_experts: int, reduced: bool = False,
    ) -> None:
        """Write sum_t w[m, t] * expert_output(m, t) into ``output`` (M, K) in place.
        ``fused_expert_output`` is (M', topk, K) per slot, or, ``reduced`` (only when
        ``accepts_reduced_output``), ``output`` itself, already summed by the experts."""

    def accepts_reduced_output(self) -> bool:
        """Whether finalize takes the experts' weighted top-k sum (M, K) in place of per-slot
        outputs, so that experts whose route reduces (``Route.reduces_topk``) write the layer output."""
        return False

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None

    def num_dispatched_tokens(self, num_tokens: int) -> int:
        """Tokens the experts see for ``num_tokens`` local ones (more when prepare gathers from
        other ranks): sizes the workspaces."""
        return num_tokens

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def copies_rows(self) -> bool:
        """Whether prepare hands the experts new contiguous rows (gathered from the ranks) rather
        than hidden_states itself (quantization aside): the plan's route reads it."""
        return False

    def runs_with_no_tokens(self) -> bool:
        """Whether prepare/finalize must run on a call with 0 tokens (every rank takes part in
        their collectives each step); otherwise such a call returns at once."""
        return False

    def check_local_experts(self, num_local_experts: int) -> None:
        """Raise unless this PrepareAndFinalize can feed ``num_local_experts`` experts (w1.shape[0])."""


class FusedMoEPermuteExpertsUnpermute(ABC):
    """Run the experts on prepared activations; no top-k weighting and no reduction.

    By value: ``kind`` names the class; ``cls.from_op_args(self.op_args(), self.quant_config)``
    rebuilds an equal instance."""

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("kind"):
            EXPERTS_KINDS[cls.kind] = cls

    def __init__(self, quant_config: FusedMoEQuantConfig | None = None) -> None:
        if quant_config is not None and not isinstance(quant_config, FusedMoEQuantConfig):
            raise TypeError(f"quant_config must be a tmoe.FusedMoEQuantConfig or None, got {quant_config!r}")
        self.quant_config = quant_config or FusedMoEQuantConfig()

    def op_args(self) -> tuple[int, ...]:
        return ()

    @classmethod
    def from_op_args(cls, args: tuple[int, ...], quant_config: FusedMoEQuantConfig) -> FusedMoEPermuteExpertsUnpermute:
        return cls(*args, quant_config=quant_config)

    def max_num_tokens(self) -> int | None:
        """Rows per expert batch (BatchedExperts format), None for the Standard format."""
        return None

    @property
    @abstractmethod
    def activation_formats(self) -> tuple[FusedMoEActivationFormat, FusedMoEActivationFormat]: ...

    def supports_chunking(self) -> bool:
        return False

    def supports_expert_map(self) -> bool:
        return False

    def supports_lora(self) -> bool:
        """Runs LoRA adapters on the expert weights (``LayerArgs.w1_lora_a`` ...)."""
        return False

    @abstractmethod
    def route(self, problem: MoEProblem, m: int, may_reduce: bool, args: LayerArgs, rows_copied: bool) -> Route:
        """The route of a chunk of ``m`` prepared tokens of ``problem``, decided once per call
        signature by the plan: ``may_reduce``: the PrepareAndFinalize accepts the weighted top-k sum,
        so a route that ``reduces_topk`` is handed the (M, K) layer output; ``args``: the call, whose
        tensors' layouts (strides, alignment) the signature fixes; ``rows_copied``: prepare hands
        the experts new contiguous rows (quantized or gathered), not views of hidden_states."""

    @abstractmethod
    def workspace_shapes(
        self, a: torch.Tensor, m: int, n: int, k: int, topk: int, num_experts: int, local_num_experts: int,
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(workspace13, workspace2, fused output) shapes from static sizes: workspace13 holds
        the down-GEMM output (the fused output is a view of it), workspace2 the activation."""

    @abstractmethod
    def apply(self, output: torch.Tensor, call: ExpertsCall, workspace13: torch.Tensor,
              workspace2: torch.Tensor) -> None:
        """Expert outputs into ``output``: per slot (the fused output shape of ``workspace_shapes``),
        or the weighted top-k sum (M, K) when ``call.route.reduces_topk``."""
