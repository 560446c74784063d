"""The layer modules: ``FusedMoEModularKernel`` (a PrepareAndFinalize + experts as one layer op
call) and ``FusedMoE`` (router + expert weights + a modular kernel). Both hold only values and
Parameters: they copy, pickle, save and compile block by block like any module."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tmoe.kernels.checks import FLOAT_DTYPES, boolean, positive_int
from tmoe.kernels.activation import Activation
from tmoe.fused import float32_router_weights, optional_bool, takes_op_path, run_layer, run_layer_op
from tmoe.modular import (
    ExpertParallel, FusedMoEPermuteExpertsUnpermute, FusedMoEPrepareAndFinalize, KernelSpec, NoEPPrepareAndFinalize,
    TritonExperts,
)
from tmoe.modular.call import LayerArgs
from tmoe.modular.checks import check_activation, check_routing
from tmoe.modular.kernel import default_chunk_size
from tmoe.modular.problem import global_expert_count


class FusedMoEModularKernel(nn.Module):
    """``prepare_finalize`` + ``fused_experts`` as one layer call.

    forward(hidden_states (M, K), w1 (E, 2N, K), w2 (E, K, N), topk_weights (M, topk) float32
    (bfloat16/float16: cast to float32 once), topk_ids (M, topk) int32/int64, inplace=False,
    **options) -> (M, K), ``options`` the other fields of ``tmoe.modular.LayerArgs`` (activation,
    global_num_experts, expert_map, scales, biases, apply_router_weight_on_input, w1_zp/w2_zp).
    Runs as the custom op ``tmoe::modular_forward``, which receives the kernel by value
    (``KernelSpec``); M is split in chunks of ``chunk_size`` tokens (default ``TMOE_CHUNK_SIZE``
    or 32768) when the experts support it, reusing one workspace.
    ``save_preactivation``: training saves the up GEMM's pre-activation for the backward (as
    ``tmoe.fused_experts``' keyword; False: recompute it). ``batch_invariant``: run every call in the
    batch-invariant mode (True), never (False), or as ``tmoe.batch_invariant()`` /
    ``TMOE_BATCH_INVARIANT`` say at each call (None; ``tmoe.fused_experts``' keyword).
    """

    def __init__(self, prepare_finalize: FusedMoEPrepareAndFinalize, fused_experts: FusedMoEPermuteExpertsUnpermute,
                 chunk_size: int | None = None, *, save_preactivation: bool = True,
                 batch_invariant: bool | None = None) -> None:
        super().__init__()
        chunk_size = default_chunk_size() if chunk_size is None else positive_int("chunk_size", chunk_size)
        self.batch_invariant = optional_bool("batch_invariant", batch_invariant)
        self.spec = KernelSpec.of(prepare_finalize, fused_experts, chunk_size, self.batch_invariant)
        self.prepare_finalize, self.fused_experts, self.chunk_size = prepare_finalize, fused_experts, chunk_size
        self.save_preactivation = boolean("save_preactivation", save_preactivation)

    def forward(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, inplace: bool = False, **options) -> torch.Tensor:
        args = LayerArgs(hidden_states, w1, w2, float32_router_weights(topk_weights), topk_ids, **options)
        if takes_op_path(args):
            return run_layer_op(args, self.spec, inplace, self.save_preactivation)
        return run_layer(args, self.spec, inplace)

    def extra_repr(self) -> str:
        return (f"{type(self.prepare_finalize).__name__} + {type(self.fused_experts).__name__}, "
                f"chunk_size={self.chunk_size}, save_preactivation={self.save_preactivation}, "
                f"batch_invariant={self.batch_invariant}")

    def warmup(self, max_tokens: int, w1: torch.Tensor, w2: torch.Tensor, topk: int, **kwargs) -> None:
        """Compile every kernel variant for 1..max_tokens tokens (powers of two and max_tokens)
        on random data, so nothing JITs during CUDA-graph capture."""
        e, k = w1.shape[0], w2.shape[1]  # w2 (E, K, N): K unpacked in every weight layout
        if "dtype" not in kwargs and w1.dtype in FLOAT_DTYPES and w1.dtype != torch.bfloat16:
            raise TypeError(f"warmup runs bfloat16 activations by default but w1 is {w1.dtype}: pass dtype={w1.dtype}")
        dtype = kwargs.pop("dtype", torch.bfloat16)
        sizes = sorted({1 << i for i in range(max_tokens.bit_length())} | {max_tokens})
        num_experts = global_expert_count(kwargs.get("global_num_experts", -1), e)
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
        for m in sizes:
            x = torch.randn(m, k, dtype=dtype, device=w1.device)
            weights, ids = torch.topk(torch.randn(m, num_experts, device=w1.device).softmax(-1), topk)
            self.forward(x, w1, w2, weights, ids.to(torch.int32), **kwargs)


@dataclass(frozen=True)
class RouterConfig:
    """How router logits become (weights, ids): see ``tmoe.topk_route``."""

    topk: int
    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_group: int = 0
    topk_group: int = 0
    routed_scaling_factor: float = 1.0


class FusedMoE(nn.Module):
    """An MoE block: out = sum_t w_t * expert_{e_t}(x) with (w, e) = topk_route(x @ router.T).

    Weights: ``router_weight`` (E, hidden) (None when the caller passes ``router_logits``),
    ``w1`` (E, 2 * intermediate, hidden) gate rows then up rows (``gate_up_interleaved``: alternating;
    a *_no_mul ``activation``: (E, intermediate, hidden)), ``w2`` (E, hidden, intermediate),
    optional ``e_score_correction_bias`` (E,) float32 for sigmoid scoring. ``activation``,
    ``swiglu_alpha``, ``swiglu_limit`` and ``gate_up_interleaved`` (``tmoe.modular.LayerArgs``) are
    kept as one ``Activation`` value (``self.activation``), a plain attribute, so that under
    torch.compile a changed float is honoured without a recompile.

    ``expert_parallel`` (``tmoe.ExpertParallel``): the experts are spread over its process group
    and this rank holds its E_local = E / W of them: ``w1``/``w2`` are (E_local, ...) in local-id
    order, the router stays (E, hidden), and the default kernel is the mode's (all-to-all or
    all-gather). ``from_experts`` takes every expert's weights and keeps this rank's.

    The router and expert weights require grad as constructed (``nn.Module``'s convention: an
    optimizer given ``parameters()`` trains them); under ``torch.no_grad()`` or
    ``torch.inference_mode()`` nothing is recorded and the call is the inference call.
    ``e_score_correction_bias`` takes no gradient (a load-balancing rule updates it) and is frozen.
    ``batch_invariant`` (None, True, False): the default kernel's mode (``FusedMoEModularKernel``); a
    ``kernel`` given takes its own.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, topk: int, *,
                 activation: str = "silu", scoring: str = "softmax", renormalize: bool = True,
                 num_expert_group: int = 0, topk_group: int = 0, routed_scaling_factor: float = 1.0,
                 score_correction_bias: bool = False, router: bool = True, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, kernel: FusedMoEModularKernel | None = None,
                 expert_parallel: ExpertParallel | None = None, swiglu_alpha: float | None = None,
                 swiglu_limit: float | None = None, gate_up_interleaved: bool = False,
                 batch_invariant: bool | None = None) -> None:
        super().__init__()
        e = positive_int("num_experts", num_experts)
        k, n = positive_int("hidden_size", hidden_size), positive_int("intermediate_size", intermediate_size)
        if not 1 <= positive_int("topk", topk) <= e:
            raise ValueError(f"topk must be in [1, num_experts={e}], got {topk}")
        act = Activation(activation, swiglu_alpha, swiglu_limit, gate_up_interleaved)
        check_activation(act)
        check_routing(e, topk, scoring, num_expert_group, topk_group)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES} (the experts' and router's dtype), got {dtype}")
        self.activation = act
        self.routing = RouterConfig(topk, scoring, renormalize, num_expert_group, topk_group, routed_scaling_factor)
        make = dict(dtype=dtype, device=device)
        self.router_weight = nn.Parameter(torch.randn(e, k, **make) / k**0.5) if router else None
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(e, device=device), requires_grad=False)
                                        if score_correction_bias else None)
        self.num_experts, self.expert_parallel = e, expert_parallel
        e_local = e if expert_parallel is None else expert_parallel.num_local_experts(e)
        self.w1 = nn.Parameter(torch.randn(e_local, act.rows_per_n * n, k, **make) / k**0.5)
        self.w2 = nn.Parameter(torch.randn(e_local, k, n, **make) / n**0.5)
        if expert_parallel is not None:
            self.register_buffer("expert_map", expert_parallel.expert_map(e, device), persistent=False)
        if kernel is not None and batch_invariant is not None:
            raise ValueError("batch_invariant= sets the default kernel's mode: pass it to the FusedMoEModularKernel "
                             "given as kernel= instead")
        bi = dict(batch_invariant=optional_bool("batch_invariant", batch_invariant))
        if kernel is None and expert_parallel is not None:
            kernel = FusedMoEModularKernel(*expert_parallel.kernel_parts(e), **bi)
        self.kernel = kernel or FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts(), **bi)

    @classmethod
    def from_experts(cls, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor], topk: int,
                     router_weight: torch.Tensor | None = None, **kwargs) -> "FusedMoE":
        """Build from per-expert linear weights: gate/up (intermediate, hidden), down (hidden,
        intermediate); ``up`` empty for a *_no_mul activation (``gate`` is then the up projection)."""
        if not isinstance(gate, (list, tuple)) or not gate:
            raise ValueError("from_experts needs at least one expert: gate must be a non-empty list of "
                             "(intermediate, hidden) tensors")
        if len(down) != len(gate) or (up and len(up) != len(gate)):
            raise ValueError(f"gate, up and down must list the same experts: got {len(gate)}, {len(up)}, {len(down)}")
        n, k = gate[0].shape
        layer = cls(len(gate), k, n, topk, router=router_weight is not None, dtype=gate[0].dtype,
                    device=gate[0].device, **kwargs)
        shard = layer.expert_parallel.shard if layer.expert_parallel is not None else (lambda t: t)
        with torch.no_grad():
            if not up:
                w1 = torch.stack(gate)
            elif layer.activation.interleaved:
                w1 = torch.stack([torch.stack([g, u], dim=1).reshape(2 * n, k) for g, u in zip(gate, up)])
            else:
                w1 = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up)])
            layer.w1.copy_(shard(w1))
            layer.w2.copy_(shard(torch.stack(down)))
            if router_weight is not None:
                layer.router_weight.copy_(router_weight)
        return layer

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        return torch.ops.tmoe.topk_route(router_logits, r.topk, r.scoring, r.renormalize, r.num_expert_group,
                                         r.topk_group, self.e_score_correction_bias, r.routed_scaling_factor)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states (..., hidden) -> (..., hidden); router_logits (tokens, E) if no router."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        if x.dtype != self.w1.dtype and self.w1.dtype in FLOAT_DTYPES:
            raise TypeError(f"hidden_states has dtype {x.dtype} but this FusedMoE's weights are {self.w1.dtype}: "
                            f"cast the input (x.to({self.w1.dtype})) or build the layer with dtype={x.dtype}")
        if router_logits is None:
            if self.router_weight is None:
                raise ValueError("router_logits must be given to a FusedMoE built without a router")
            router_logits = F.linear(x, self.router_weight)
        elif router_logits.dim() != 2 or router_logits.shape != (x.shape[0], self.num_experts):
            raise ValueError(f"router_logits must be (tokens={x.shape[0]}, num_experts={self.num_experts}), "
                             f"got shape {tuple(router_logits.shape)}")
        weights, ids = self.route(router_logits)
        ep = {} if self.expert_parallel is None else {"global_num_experts": self.num_experts,
                                                       "expert_map": self.expert_map}
        out = self.kernel(x, self.w1, self.w2, weights, ids, **self.activation.layer_kwargs(), **ep)
        return out.view(hidden_states.shape)
