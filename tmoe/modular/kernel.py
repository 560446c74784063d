"""The modular kernel as a value: ``KernelSpec`` (which PrepareAndFinalize, which experts, the
quant config, the chunk size, all primitives) and ``ModularKernel``, the eager composition
prepare -> experts -> finalize that the layer op rebuilds from a spec (cached per spec)."""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from tmoe.config import config_state, resolve_batch_invariant
from tmoe.runtime import state
from tmoe.runtime.interpreter import with_interpreter_fixes
from tmoe.runtime.plan import LaunchSequence
from tmoe.runtime.replay import CallReplay
from tmoe.modular.call import LayerArgs
from tmoe.modular.checks import (
    call_signature, check_batch_invariant, check_layer_call, check_recorded_call, check_static_scales, check_trainable,
    saves_preactivation,
)
from tmoe.modular.interfaces import (
    EXPERTS_KINDS, PREPARE_FINALIZE_KINDS, ExpertsCall, FusedMoEPermuteExpertsUnpermute, FusedMoEPrepareAndFinalize,
    Route,
)
from tmoe.modular.lora_checks import has_lora, lora_weights
from tmoe.modular.problem import MoEProblem
from tmoe.modular.quant_config import FusedMoEQuantConfig

DEFAULT_CHUNK_SIZE = 32768
MAX_CALL_PLANS = 4096  # per modular kernel; cleared when full (plans hold sizes, no tensors)
# the int lists are optional, None for an empty one: an AOTInductor package passes an empty int[] as None
SPEC_SCHEMA = ("str prepare_finalize, int[]? prepare_finalize_args, str group_name, str experts, int[]? experts_args, "
               "str? quant_dtype, bool per_act_token_quant, bool per_out_ch_quant, int[]? block_shape, str? weight_dtype, int group_size, int chunk_size, "
               "bool? batch_invariant")


@functools.lru_cache(maxsize=None)
def _env_chunk_size(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_CHUNK_SIZE
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"TMOE_CHUNK_SIZE must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"TMOE_CHUNK_SIZE must be a positive integer, got {raw!r}")
    return value


def default_chunk_size() -> int:
    """``TMOE_CHUNK_SIZE`` from the environment, else 32768 tokens."""
    return _env_chunk_size(os.environ.get("TMOE_CHUNK_SIZE"))


def check_compatible(pf: FusedMoEPrepareAndFinalize, experts: FusedMoEPermuteExpertsUnpermute) -> None:
    """The two halves agree on the activation format and, for fixed-capacity batches, on the capacity."""
    for name, obj, base in (("prepare_finalize", pf, FusedMoEPrepareAndFinalize),
                            ("fused_experts", experts, FusedMoEPermuteExpertsUnpermute)):
        if not isinstance(obj, base):
            raise TypeError(f"{name} must be a {base.__name__}, got {type(obj).__name__}")
        if not type(obj).kind:
            raise TypeError(f"{type(obj).__name__} must set a class attribute `kind` (its by-value name)")
    if pf.activation_format != experts.activation_formats[0]:
        raise ValueError(
            f"{type(pf).__name__} produces {pf.activation_format.name} activations "
            f"but {type(experts).__name__} takes {experts.activation_formats[0].name}"
        )
    cap_pf, cap_ex = pf.max_num_tokens_per_rank(), experts.max_num_tokens()
    if cap_pf is not None and cap_ex is not None and cap_pf != cap_ex:
        raise ValueError(f"{type(pf).__name__}(max_num_tokens={cap_pf}) and {type(experts).__name__}"
                         f"(max_num_tokens={cap_ex}) must agree on the batch capacity")


@dataclass(frozen=True)
class KernelSpec:
    """What a modular kernel is, by value: equal specs build equal kernels and trace to one graph."""

    prepare_finalize: str
    prepare_finalize_args: tuple[int, ...]
    group_name: str
    experts: str
    experts_args: tuple[int, ...]
    quant: FusedMoEQuantConfig
    chunk_size: int = 0  # 0: default_chunk_size(), read inside the op
    batch_invariant: bool | None = None  # None: tmoe.batch_invariant() / TMOE_BATCH_INVARIANT, read inside the op

    @classmethod
    def of(cls, pf: FusedMoEPrepareAndFinalize, experts: FusedMoEPermuteExpertsUnpermute,
           chunk_size: int = 0, batch_invariant: bool | None = None) -> KernelSpec:
        check_compatible(pf, experts)
        return cls(type(pf).kind, tuple(pf.op_args()), pf.group_name(), type(experts).kind,
                   tuple(experts.op_args()), experts.quant_config, chunk_size, batch_invariant)

    def as_args(self) -> tuple:
        """The layer op's trailing arguments (``SPEC_SCHEMA``)."""
        return (self.prepare_finalize, list(self.prepare_finalize_args) or None, self.group_name, self.experts,
                list(self.experts_args) or None, *self.quant.as_args(), self.chunk_size, self.batch_invariant)

    @classmethod
    def from_args(cls, pf: str, pf_args: list[int] | None, group_name: str, experts: str,
                  experts_args: list[int] | None, quant_dtype: str | None, per_act_token: bool, per_out_ch: bool,
                  block_shape: list[int] | None, weight_dtype: str | None, group_size: int, chunk_size: int,
                  batch_invariant: bool | None = None) -> KernelSpec:
        quant = FusedMoEQuantConfig.from_args(quant_dtype, per_act_token, per_out_ch, block_shape, weight_dtype,
                                              group_size)
        return cls(pf, tuple(pf_args or ()), group_name, experts, tuple(experts_args or ()), quant, chunk_size,
                   batch_invariant)

    def __post_init__(self) -> None:
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            raise TypeError(f"batch_invariant must be a bool or None, got {self.batch_invariant!r}")
        # the face passes these on every layer op call: computed once (a plain attribute, which
        # dynamo reads as it reads any module attribute; not a field: equality stays the fields')
        object.__setattr__(self, "op_args", self.as_args())

    def check_trainable(self, args: LayerArgs) -> None:
        """Raise before any launch unless a call of this kernel has a backward (``check_trainable``)
        and the call's scales and frozen weights allow one (``check_recorded_call``)."""
        check_trainable(args, self.prepare_finalize, self.experts, self.quant.dtype_name, self.quant.weight_dtype)
        check_recorded_call(args, self.quant)
        if args.lora_ids is not None:
            raise NotImplementedError("stacked adapters with lora_ids (serving several adapters) run the forward only: "
                                      "call under torch.no_grad() or train one adapter ((E, r, C) factors)")
        if has_lora(args) and self.prepare_finalize != "noep":
            raise NotImplementedError("training LoRA adapters runs on NoEPPrepareAndFinalize (one device), not with "
                                      f"expert parallelism ({self.prepare_finalize!r})")

    def check_call(self, args: LayerArgs) -> None:
        """The mode's refusals (``check_batch_invariant``) where the mode is on (the layer op's fake)."""
        if resolve_batch_invariant(self.batch_invariant):
            check_batch_invariant(args, self.quant)

    @property
    def saves_preactivation(self) -> bool:
        """Whether a training call's forward can save its pre-activation (``saves_preactivation``)."""
        return saves_preactivation(self.prepare_finalize, self.experts, self.quant.quant_dtype is not None)


_NUM_LAYER_ARGS = len(LayerArgs._fields)


def split_op_args(args: tuple) -> tuple[LayerArgs, KernelSpec]:
    """A layer op's arguments (``LayerArgs``' then ``SPEC_SCHEMA``'s) as the two values."""
    return LayerArgs(*args[:_NUM_LAYER_ARGS]), KernelSpec.from_args(*args[_NUM_LAYER_ARGS:])


class ChunkPlan(NamedTuple):
    """One chunk of a call: its token range, the experts' route and the workspace and fused-output shapes."""

    start: int
    end: int
    route: Route
    ws13: tuple[int, ...]
    ws2: tuple[int, ...]
    out: tuple[int, ...]


class CallPlan(NamedTuple):
    """What a call's signature fixes: the token count, the problem (sizes, expert counts, the
    activation), the chunks and their routes, the sequence of planned launches (recorded on the
    first call, replayed after) and the whole call's launches (recorded on the second call,
    replayed after; not with a process group: collectives are no Triton launches)."""

    m: int
    problem: MoEProblem
    chunks: tuple[ChunkPlan, ...]  # the first is the largest
    launches: LaunchSequence
    replay: CallReplay | None


class ModularKernel:
    """prepare -> experts -> finalize over chunks of tokens, eagerly (the layer op's body). The
    checks and sizes of a call are computed once per call signature (``call_signature``: each
    tensor's shape, strides, dtype and device, every other argument's value) and kept in a plan."""

    def __init__(self, pf: FusedMoEPrepareAndFinalize, experts: FusedMoEPermuteExpertsUnpermute,
                 chunk_size: int, batch_invariant: bool | None = None) -> None:
        # chunk_size 0: default_chunk_size() at each call; batch_invariant None: the context's at each call
        check_compatible(pf, experts)
        self.prepare_finalize, self.fused_experts, self.chunk_size = pf, experts, chunk_size
        self.batch_invariant = batch_invariant
        self._plans: dict[tuple, CallPlan] = {}
        self._generation = state.generation()

    @with_interpreter_fixes  # one swap for the call's launches (CPU); a no-op on a GPU
    def run(self, output: torch.Tensor, args: LayerArgs, preact: torch.Tensor | None = None) -> torch.Tensor:
        """Writes the layer output into ``output`` (M, K) and returns it; ``preact`` (M * topk, 2N)
        (N for a *_no_mul activation), contiguous, x's dtype: also save each slot's pre-activation
        there (training; ``TritonExperts`` only, on its routes that keep the slots apart)."""
        chunk_size = self.chunk_size or default_chunk_size()
        key = (call_signature(args), output.stride(), output.dtype, output.data_ptr() % 16,
               output.data_ptr() == args.hidden_states.data_ptr(), chunk_size, config_state(), preact is not None)
        if self._generation != state.generation():  # clear_launch_caches: the routes' thresholds may have changed
            self._plans.clear()
            self._generation = state.generation()
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(args, chunk_size, preact is not None, resolve_batch_invariant(self.batch_invariant))
            if len(self._plans) >= MAX_CALL_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        check_static_scales(args)
        m = plan.m
        if m == 0 and not self.prepare_finalize.runs_with_no_tokens():
            return output
        if plan.replay is None:
            return self._run_planned(output, args, plan, preact)
        inputs = (output, *args) if preact is None else (output, *args, preact)
        return plan.replay.run(inputs, lambda: self._run_planned(output, args, plan, preact))

    def _run_planned(self, output: torch.Tensor, args: LayerArgs, plan: CallPlan,
                     preact: torch.Tensor | None) -> torch.Tensor:
        with plan.launches.active():  # the first call of a signature records its launches, later ones replay them
            return self._run_chunks(output, args, plan, preact)

    def _run_chunks(self, output: torch.Tensor, args: LayerArgs, plan: CallPlan,
                    preact: torch.Tensor | None) -> torch.Tensor:
        x, first = args.hidden_states, plan.chunks[0]
        if len(plan.chunks) == 1:  # one chunk (an empty one when a collective prepare/finalize must run): no slicing
            self._run_chunk(output, args, x, args.topk_ids, args.topk_weights, plan, first,
                            torch.empty(first.ws13, dtype=x.dtype, device=x.device),
                            torch.empty(first.ws2, dtype=x.dtype, device=x.device), preact, args.lora_ids)
            return output
        workspace13 = torch.empty(math.prod(first.ws13), dtype=x.dtype, device=x.device)
        workspace2 = torch.empty(math.prod(first.ws2), dtype=x.dtype, device=x.device)
        for c in plan.chunks:
            rows = slice(c.start, c.end)
            self._run_chunk(output[rows], args, x[rows], args.topk_ids[rows], args.topk_weights[rows], plan, c,
                            workspace13[: math.prod(c.ws13)].view(c.ws13), workspace2[: math.prod(c.ws2)].view(c.ws2),
                            None if preact is None else preact[c.start * plan.problem.topk: c.end * plan.problem.topk],
                            None if args.lora_ids is None else args.lora_ids[rows])
        return output

    def _plan(self, args: LayerArgs, chunk_size: int, saves_preact: bool, batch_invariant: bool) -> CallPlan:
        """Check a call and size its chunks and workspaces (once per call signature); a call that
        saves its pre-activation takes no route that sums the top-k slots. ``batch_invariant``: the
        mode, decided here once for the call (the key holds ``config_state``) and carried by the problem."""
        experts, pf = self.fused_experts, self.prepare_finalize
        problem = check_layer_call(args, experts.quant_config)
        if batch_invariant:
            check_batch_invariant(args, experts.quant_config)
            problem = replace(problem, batch_invariant=True)
        if args.expert_map is not None and not experts.supports_expert_map():
            raise ValueError(f"{type(experts).__name__} does not support expert_map")
        if problem.lora and not experts.supports_lora():
            raise NotImplementedError(f"{type(experts).__name__} does not run LoRA adapters (w1_lora_a ...); "
                                      "TritonExperts does")
        if problem.lora_adapters and pf.kind != "noep":
            raise NotImplementedError("stacked adapters with lora_ids run on NoEPPrepareAndFinalize (one device), not "
                                      f"with expert parallelism ({pf.kind!r})")
        x = args.hidden_states
        m = x.shape[0]
        n, k, topk, e_local = problem.n, problem.k, problem.topk, problem.num_local_experts
        pf.check_local_experts(e_local)
        chunk = max(1, min(m, chunk_size) if experts.supports_chunking() else m)
        may_reduce = pf.accepts_reduced_output() and not saves_preact
        rows_copied = pf.copies_rows() or experts.quant_config.quant_dtype is not None
        chunks = []
        for start in range(0, max(m, 1), chunk):  # m == 0: one empty chunk
            end = min(m, start + chunk)
            rows = pf.num_dispatched_tokens(end - start)
            route = experts.route(problem, rows, may_reduce, args, rows_copied)
            if route.reduces_topk and not may_reduce:
                raise ValueError(f"{type(experts).__name__} chose route {route.name}, which sums the top-k slots, "
                                 f"but {type(pf).__name__} does not accept reduced output")
            chunks.append(ChunkPlan(start, end, route, *experts.workspace_shapes(x[start:end], rows, n, k, topk,
                                                                                  problem.num_experts, e_local)))
        replay = None if pf.group_name() else CallReplay()
        return CallPlan(m, problem, tuple(chunks), LaunchSequence(), replay)

    def _run_chunk(self, output: torch.Tensor, args: LayerArgs, x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, plan: CallPlan, chunk: ChunkPlan, ws13: torch.Tensor,
                   ws2: torch.Tensor, preact: torch.Tensor | None, lora_ids: torch.Tensor | None) -> None:
        experts, pf = self.fused_experts, self.prepare_finalize
        on_input = args.apply_router_weight_on_input
        problem = plan.problem
        prepared = pf.prepare(x, weights, ids, problem.num_experts, args.expert_map, on_input, experts.quant_config,
                              args.a1_scale)
        reduced = chunk.route.reduces_topk
        fused_out = output if reduced else ws13.view(chunk.out)
        call = ExpertsCall(
            chunk.route, problem, prepared.a1q, prepared.a1q_scale,
            prepared.expert_num_tokens, prepared.topk_weights if prepared.topk_weights is not None else weights,
            prepared.topk_ids if prepared.topk_ids is not None else ids, args.w1, args.w2, args.expert_map,
            args.w1_scale, args.w2_scale, args.a2_scale, args.w1_bias, args.w2_bias, args.w1_zp, args.w2_zp, on_input,
            preact, lora_weights(args, "w1", lora_ids), lora_weights(args, "w2", lora_ids),
            x if args.w1_lora_a is not None and prepared.a1q.dtype != x.dtype else None,
        )
        experts.apply(fused_out, call, ws13, ws2)
        pf.finalize(output, fused_out, weights, ids, on_input, num_experts=problem.num_experts,
                    expert_map=args.expert_map, prepared=prepared, num_local_experts=problem.num_local_experts,
                    reduced=reduced)


@functools.lru_cache(maxsize=256)
def build(spec: KernelSpec) -> ModularKernel:
    """The ModularKernel a spec describes (one per spec)."""
    try:
        pf_cls, ex_cls = PREPARE_FINALIZE_KINDS[spec.prepare_finalize], EXPERTS_KINDS[spec.experts]
    except KeyError as err:
        raise ValueError(f"unknown modular kernel part {err.args[0]!r}; known: "
                         f"{sorted(PREPARE_FINALIZE_KINDS)} and {sorted(EXPERTS_KINDS)}") from None
    pf = pf_cls.from_op_args(spec.prepare_finalize_args, spec.group_name)
    experts = ex_cls.from_op_args(spec.experts_args, spec.quant)
    return ModularKernel(pf, experts, spec.chunk_size, spec.batch_invariant)
