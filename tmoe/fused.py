"""``tmoe.fused_experts``: vLLM's fused-MoE call, run by the default modular kernel.

Under torch.compile (or when autograd would record the call) it goes through the layer op
``tmoe::modular_forward``; in plain eager calls it runs the op's body directly, which skips the
dispatcher's host time (tens of microseconds per call) and nothing else."""
from __future__ import annotations

import torch

from tmoe.modular import KernelSpec, NoEPPrepareAndFinalize, TritonExperts, build
from tmoe.modular.call import LayerArgs
from tmoe.kernels.checks import boolean
from tmoe.modular.checks import check_no_grad_inplace, check_no_overlap, low_bit_needs_saved_preactivation, needs_grad
from tmoe.modular.quant_config import FusedMoEQuantConfig

_NO_QUANT = FusedMoEQuantConfig()
_DEFAULT_SPECS: dict[tuple[FusedMoEQuantConfig, bool | None], KernelSpec] = {}


def _default_spec(quant_config: FusedMoEQuantConfig, batch_invariant: bool | None) -> KernelSpec:
    """NoEPPrepareAndFinalize() + TritonExperts(quant_config); the chunk size 0 means TMOE_CHUNK_SIZE
    and batch_invariant None the context's (both read inside the op)."""
    key = (quant_config, batch_invariant)
    spec = _DEFAULT_SPECS.get(key)
    if spec is None:
        spec = _DEFAULT_SPECS[key] = KernelSpec.of(NoEPPrepareAndFinalize(), TritonExperts(quant_config),
                                                   batch_invariant=batch_invariant)
    return spec


for _flag in (None, True, False):  # the unquantized specs exist before dynamo first traces a call: their
    _default_spec(_NO_QUANT, _flag)  # lookup never adds to the dict it guards on (a recompile)


def optional_bool(name: str, value: object) -> bool | None:
    """``value`` if it is None or a bool, else a TypeError naming the argument."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool or None, got {value!r}")
    return value


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def float32_router_weights(topk_weights: torch.Tensor) -> torch.Tensor:
    """Router weights as the kernels read them: bfloat16/float16 ones (every transformers router
    gives them in the model's dtype) cast to float32 once, exactly and differentiably (their
    gradient flows back in their own dtype); any other value as given, for the checks to name."""
    if isinstance(topk_weights, torch.Tensor) and topk_weights.dtype in _HALF_DTYPES:
        return topk_weights.float()
    return topk_weights


def takes_op_path(args: LayerArgs) -> bool:
    """Whether the call must go through the custom op: under torch.compile (the op is what gets
    traced), on the meta device or under a dispatch mode (FakeTensorMode, FlopCounterMode, a
    user's TorchDispatchMode: the mode must see the op), with a tensor subclass among the tensors,
    or when autograd would record it (the op's autograd formula runs the backward). Raises
    TypeError naming the argument when one of the five tensors is not a tensor."""
    for name, t in zip(LayerArgs._fields, args[:5]):
        if type(t) not in _PLAIN_TENSORS:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            return True
    if torch.compiler.is_compiling() or args.hidden_states.is_meta or torch._C._len_torch_dispatch_stack():
        return True
    return needs_grad(args)


def run_layer(args: LayerArgs, spec: KernelSpec, inplace: bool) -> torch.Tensor:
    """Eager call of the layer op's body (the dispatcher adds host time and nothing else here)."""
    if inplace:
        check_no_grad_inplace(args.hidden_states)
        check_no_overlap(args.hidden_states)
        return build(spec).run(args.hidden_states, args)
    return build(spec).run(torch.empty_like(args.hidden_states), args)


def run_layer_op(args: LayerArgs, spec: KernelSpec, inplace: bool, save_preactivation: bool = True) -> torch.Tensor:
    """Call the layer op ``tmoe::modular_forward`` (in place: ``tmoe::modular_forward_``); a call
    autograd records runs ``tmoe::modular_forward_train`` where it can (``saves_preactivation``)
    and ``save_preactivation`` asks for it: its backward then reads the saved pre-activation."""
    spec_args = spec.op_args
    if inplace:
        check_no_grad_inplace(args.hidden_states)
        torch.ops.tmoe.modular_forward_(*args, *spec_args)
        return args.hidden_states
    if needs_grad(args):  # before any launch: the composition and weights must have a backward
        if not torch.compiler.is_compiling():  # compiled: the op's autograd setup checks on fake tensors
            spec.check_trainable(args)
        if save_preactivation and spec.saves_preactivation:
            return torch.ops.tmoe.modular_forward_train(*args, *spec_args)[0]
        if spec.quant.weight_dtype is not None and not torch.compiler.is_compiling():  # compiled: the op's setup
            raise NotImplementedError(low_bit_needs_saved_preactivation(spec.quant.weight_dtype))
    return torch.ops.tmoe.modular_forward(*args, *spec_args)


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    inplace: bool = False,
    quant_config: FusedMoEQuantConfig | None = None,
    save_preactivation: bool = True,
    batch_invariant: bool | None = None,
    **options,
) -> torch.Tensor:
    """out[m] = sum_t topk_weights[m, t] * w2[e] @ (act(w1[e, :N] @ x[m]) * (w1[e, N:] @ x[m])), e = topk_ids[m, t]
    (a *_no_mul activation: w2[e] @ act(w1[e] @ x[m])).

    Args:
        hidden_states: (M, K) float16/bfloat16/float32.
        w1: (E, 2N, K), gate rows then up rows ((E, N, K) for a *_no_mul activation); w2:
            (E, K, N). Same dtype as hidden_states, or float8_e4m3fn with ``quant_config`` and
            ``w1_scale``/``w2_scale``, or uint8 int4/int8/mxfp4 codes in vLLM's packed layouts
            (``FusedMoEQuantConfig(weight_dtype=...)``, group scales ``w1_scale``/``w2_scale``,
            optional zero points ``w1_zp``/``w2_zp``; README).
        topk_weights: (M, topk) float32, or bfloat16/float16 (a model's router; cast to float32
            once, the gradient returned in their dtype); topk_ids: (M, topk) int32/int64. Ids outside
            [0, E) contribute exactly 0.
        inplace: write the result into ``hidden_states`` (refused if it requires grad).
        quant_config: ``tmoe.FusedMoEQuantConfig`` (fp8 or weight-only low-bit schemes); None: unquantized.
        save_preactivation: when autograd records the call, the forward also saves the up GEMM's
            pre-activation (M * topk * 2N values, as torch autograd of the eager layer does) and the
            backward reads it; False: the backward recomputes it from x and w1 (less memory, one more
            GEMM). Float experts without expert parallelism only; other layers always recompute.
        batch_invariant: True: each token's output row (and, training, its input-gradient row) is
            the same bits whatever the other tokens, their number and its position
            (``docs/numerics.md``); per-tensor fp8 then needs static ``a1_scale``/``a2_scale``.
            None: ``tmoe.batch_invariant()`` or ``TMOE_BATCH_INVARIANT``, read at each call.
        **options: the other fields of ``tmoe.modular.LayerArgs``: ``activation`` (gated: "silu",
            "gelu", "gelu_tanh", "swigluoai"; non-gated: "silu_no_mul", "gelu_no_mul",
            "relu2_no_mul"), ``swiglu_alpha``/``swiglu_limit`` (swigluoai's alpha and limit,
            default 1.702 and 7.0; a limit on silu clamps it: min(silu(gate), L) * clamp(up, -L, L)),
            ``gate_up_interleaved`` (w1 rows alternate gate, up: GPT-OSS's layout),
            ``global_num_experts`` and ``expert_map`` (expert parallelism: (E_global,) int32, global
            id to local id or -1), ``w1_scale``/``w2_scale``,
            ``a1_scale``/``a2_scale`` (static per-tensor fp8 activation scales),
            ``apply_router_weight_on_input`` (topk == 1), ``w1_bias`` (E, 2N) / ``w2_bias`` (E, K),
            ``w1_zp``/``w2_zp`` (int4/int8 zero points), LoRA adapters on the experts
            ``w1_lora_a`` (E, r1, K) / ``w1_lora_b`` (E, 2N, r1), ``w2_lora_a`` (E, r2, N) /
            ``w2_lora_b`` (E, K, r2) in hidden_states' dtype, r <= 128, and ``lora_scale`` (None: 1.0;
            the experts run w + lora_scale * b @ a without forming it: docs/lora.md).

    Returns:
        (M, K) tensor in hidden_states.dtype.

    Example:
        >>> w, ids = torch.topk(torch.softmax(logits, -1), 2)
        >>> out = tmoe.fused_experts(x, w1, w2, w, ids.int())
    """
    args = LayerArgs(hidden_states, w1, w2, float32_router_weights(topk_weights), topk_ids, **options)
    quant_config = quant_config or _NO_QUANT
    if type(quant_config) is not FusedMoEQuantConfig:
        raise TypeError(f"quant_config must be a tmoe.FusedMoEQuantConfig (e.g. FusedMoEQuantConfig(torch.float8_e4m3fn)), "
                        f"got {quant_config!r}")
    save_preactivation = boolean("save_preactivation", save_preactivation)  # checked on every path
    spec = _default_spec(quant_config, optional_bool("batch_invariant", batch_invariant))
    if takes_op_path(args):
        return run_layer_op(args, spec, inplace, save_preactivation)
    return run_layer(args, spec, inplace)
