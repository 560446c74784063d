"""Checks of a layer call that raise before any launch, naming the argument. Plain Python on
shapes, dtypes and devices, so the same function serves the eager op and its fake (on fake
tensors a dimension check becomes an equality guard, never a data-dependent branch)."""
from __future__ import annotations

import math

import torch

from tmoe.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_shape, check_tensor
from tmoe.kernels.activation import ACTIVATIONS, Activation
from tmoe.kernels.router import SCORINGS
from tmoe.kernels.operands import check_low_bit_operand, codes_per_byte
from tmoe.modular.call import LayerArgs
from tmoe.modular.lora_checks import check_lora
from tmoe.modular.problem import MoEProblem, global_expert_count
from tmoe.modular.quant_config import FusedMoEQuantConfig
from tmoe.runtime import interpreter

_TENSORS = ("expert_map", "w1_scale", "w2_scale", "a1_scale", "a2_scale", "w1_bias", "w2_bias", "w1_zp", "w2_zp")


def _intermediate_size(args: LayerArgs, activation: Activation, pack: int = 1) -> int:
    """N from w1's rows and the activation (the one place a call derives it), after checking that
    the rows fit the activation: gate and up rows of 2N, or N rows for a *_no_mul one (w2 (E, K,
    N / ``pack``) tells a gated layout given to a non-gated activation)."""
    rows, per_n = args.w1.shape[1], activation.rows_per_n
    if rows % per_n:
        raise ValueError(f"w1 must be (E, 2N, K) with gate rows then up rows; got {rows} rows")
    if per_n == 1 and args.w2.shape[2] * pack * 2 == rows:  # gate and up rows for a non-gated activation
        k_in, n_in = ("K", "N") if pack == 1 else (f"K / {pack}", f"N / {pack}")
        raise ValueError(f"w1 must be (E, N, {k_in}) for activation {args.activation!r}: w2 (E, K, "
                         f"{n_in}={args.w2.shape[2]}) needs {rows // 2} rows of w1, got {rows}")
    return activation.intermediate_size(rows)


def check_low_bit_weights(args: LayerArgs, quant: FusedMoEQuantConfig, activation: Activation) -> tuple[int, int]:
    """Weight-only int4/int8/mxfp4 (layouts: ``tmoe.kernels.operands.WeightScales``): w1 uint8
    (E, 2N, K / p) ((E, N, K / p) for a *_no_mul activation), w2 uint8 (E, K, N / p), p = 2 for the
    4-bit schemes; scales (E, rows, cdiv(K_in, g)), float (e8m0 uint8 for mxfp4); zero points uint8
    (E, rows / p, cdiv(K_in, g)). Returns (E, N)."""
    x, wd = args.hidden_states, quant.weight_dtype
    k = x.shape[1]
    pack = codes_per_byte(wd)
    for name in ("w1", "w2"):
        check_tensor(name, getattr(args, name), dtypes=(torch.uint8,), ndim=3, device=x.device)
    e, w1_rows = args.w1.shape[0], args.w1.shape[1]
    n = _intermediate_size(args, activation, pack)
    if args.a1_scale is not None or args.a2_scale is not None:
        raise ValueError(f"a1_scale/a2_scale are fp8 activation scales; {wd} weights keep activations unquantized")
    # the operand check owns the packing rule (K_in a multiple of the codes per byte): K for w1, N for w2
    for name, shape, hint in (("w1", (e, w1_rows, k), f" for hidden_states (M, K={k})"),
                              ("w2", (e, k, n), f" for the intermediate size N={n} (w1's {w1_rows} rows)")):
        check_low_bit_operand(name, getattr(args, name), f"{name}_scale", getattr(args, f"{name}_scale"), f"{name}_zp",
                              getattr(args, f"{name}_zp"), wd, quant.group_size, shape, x.device, hint)
    return e, n


def call_signature(args: LayerArgs) -> tuple:
    """What ``check_layer_call``, the sizing of a call and its launches depend on: each tensor's
    shape, strides, dtype, device and 16-byte alignment, every other argument's value."""
    return tuple((a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a
                 for a in args)


def check_layer_call(args: LayerArgs, quant: FusedMoEQuantConfig) -> MoEProblem:
    """Shape, dtype and device checks of one layer call; returns what the call is apart from its
    token count (``MoEProblem``), which the plan and the backward carry. ``quant``'s dtype is the
    weights' (None: w1/w2 have hidden_states' dtype; fp8: w1/w2 fp8 with their scales;
    ``weight_dtype``: low-bit codes)."""
    x = args.hidden_states
    check_tensor("hidden_states", x, dtypes=FLOAT_DTYPES, ndim=2)
    dev = x.device
    if dev.type == "cpu" and not interpreter.INTERPRETED and torch.cuda.is_available():  # a model left on the CPU
        raise ValueError("hidden_states is on the CPU, where tmoe's kernels do not run here: move the layer to "
                         "CUDA (the Triton interpreter runs them on CPU only where no GPU is present, or with "
                         "TRITON_INTERPRET=1 set before importing tmoe)")
    for name in _TENSORS:
        t = getattr(args, name)
        if t is not None:
            check_tensor(name, t, device=dev)
    m, k = x.shape
    activation = args.activation_value()
    if quant.weight_dtype is not None:
        check_activation(activation)
        e, n = check_low_bit_weights(args, quant, activation)
    else:
        e, n = _check_weights(args, quant, activation)
    rows = args.w1.shape[1]
    check_tensor("topk_ids", args.topk_ids, dtypes=INDEX_DTYPES, ndim=2, device=dev, contiguous=True)
    check_tensor("topk_weights", args.topk_weights, dtypes=(torch.float32,), ndim=2, device=dev, contiguous=True)
    if args.topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids must be (M={m}, topk) like hidden_states; got shape {tuple(args.topk_ids.shape)}")
    check_shape("topk_weights", args.topk_weights, tuple(args.topk_ids.shape))
    if args.apply_router_weight_on_input and args.topk_ids.shape[1] != 1:
        raise ValueError("apply_router_weight_on_input needs topk == 1")
    for name, bias_rows in (("w1_bias", rows), ("w2_bias", k)):
        bias = getattr(args, name)
        if bias is not None:
            check_tensor(name, bias, dtypes=FLOAT_DTYPES, ndim=2)
            check_shape(name, bias, (e, bias_rows))
            if bias.stride(1) != 1:
                raise ValueError(f"{name} must be contiguous along its last dimension")
    num_experts = global_expert_count(args.global_num_experts, e)
    if args.expert_map is not None:
        check_tensor("expert_map", args.expert_map, dtypes=(torch.int32,), ndim=1, contiguous=True)
        check_shape("expert_map", args.expert_map, (num_experts,))
    elif num_experts != e:
        raise ValueError(f"global_num_experts={num_experts} differs from w1's {e} experts but no expert_map given")
    if quant.scheme == "block":
        bk = quant.block_shape[1]
        if k % bk or n % bk:
            raise ValueError(f"block_shape[1]={bk} (the activation group size) must divide the hidden size K={k} "
                             f"and the intermediate size N={n}")
    lora_ranks, lora_adapters = check_lora(args, e, rows, n)
    return MoEProblem(num_experts, e, n, k, args.topk_ids.shape[1], activation, x.dtype, args.w1.dtype,
                      lora_ranks=lora_ranks, lora_adapters=lora_adapters)


def check_activation(activation: Activation) -> None:
    """The activation and its options, named as the layer takes them: a known ``activation``;
    ``swiglu_alpha`` only with swigluoai (finite); ``swiglu_limit`` only with silu or swigluoai
    (> 0); ``gate_up_interleaved`` only when gated."""
    act = activation.name
    if act not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {act!r}")
    for name, value, acts in (("swiglu_alpha", activation.alpha, ("swigluoai",)),
                              ("swiglu_limit", activation.limit, ("silu", "swigluoai"))):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float, torch.SymFloat, torch.SymInt)):
            raise TypeError(f"{name} must be a float or None, got {type(value).__name__}")
        if act not in acts:
            raise ValueError(f"{name} applies to activation {' or '.join(acts)}, not {act!r}")
        if name == "swiglu_alpha" and isinstance(value, (int, float)) and not math.isfinite(value):
            raise ValueError(f"swiglu_alpha must be finite, got {value}")
        if name == "swiglu_limit" and isinstance(value, (int, float)) and not value > 0:
            raise ValueError(f"swiglu_limit must be > 0, got {value}")
    if activation.interleaved and not activation.mul:
        raise ValueError(f"gate_up_interleaved needs a gated activation (w1 with gate and up rows), not {act!r}")


def _check_weights(args: LayerArgs, quant: FusedMoEQuantConfig, activation: Activation) -> tuple[int, int]:
    """w1 (E, 2N, K) ((E, N, K) for a *_no_mul activation), w2 (E, K, N) in hidden_states' dtype,
    or fp8 with their scales; the activation and its options. Returns (E, N)."""
    x, w1, w2 = args.hidden_states, args.w1, args.w2
    weight_dtype = quant.quant_dtype or x.dtype
    why = "the quant config's dtype" if quant.quant_dtype else "hidden_states' dtype; pass a quant_config for fp8 weights"
    for name, w, scale_name in (("w1", w1, "w1_scale"), ("w2", w2, "w2_scale")):
        check_tensor(name, w, ndim=3, device=x.device)
        if w.dtype != weight_dtype:
            raise TypeError(f"{name} has dtype {w.dtype}, expected {weight_dtype} ({why})")
        if quant.quant_dtype is not None and getattr(args, scale_name) is None:
            raise ValueError(f"fp8 experts need {scale_name}")
    if args.w1_zp is not None or args.w2_zp is not None:
        raise ValueError("w1_zp/w2_zp are zero points of int4/int8 weights; pass "
                         "quant_config=FusedMoEQuantConfig(weight_dtype='int4' or 'int8', group_size=g)")
    check_activation(activation)
    k = x.shape[1]
    e, rows, k1 = w1.shape
    if rows % activation.rows_per_n == 0 and k1 != k:
        raise ValueError(f"w1 must be (E, {'2N' if activation.mul else 'N'}, K={k}) to match hidden_states (M, K={k}); "
                         f"got shape {tuple(w1.shape)}")
    n = _intermediate_size(args, activation)
    check_shape("w2", w2, (e, k, n))
    return e, n


def check_static_scales(args: LayerArgs) -> None:
    """Reject a zero, negative or non-finite static activation scale held in host memory. A scale
    on a GPU is not read (that would sync the host): there such a scale gives inf/NaN codes."""
    for name in ("a1_scale", "a2_scale"):
        scale = getattr(args, name)
        if scale is not None and scale.device.type == "cpu":
            check_tensor(name, scale, dtypes=(torch.float32,))
            if scale.numel() != 1:
                raise ValueError(f"{name} must hold one element (a static per-tensor scale), got shape "
                                 f"{tuple(scale.shape)}")
            if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
                raise ValueError(f"{name} must be a positive finite scale, got {scale.reshape(-1).tolist()}")


def check_batch_invariant(args: LayerArgs, quant: FusedMoEQuantConfig) -> None:
    """A batch-invariant call cannot scale its fp8 activations per tensor dynamically: one scale
    from the whole batch's largest value changes every token's codes with the batch."""
    if quant.scheme != "tensor":
        return
    for name in ("a1_scale", "a2_scale"):
        if getattr(args, name) is None:
            raise ValueError(f"batch_invariant=True with per-tensor fp8 needs a static {name}: a dynamic "
                             f"per-tensor scale ({name}=None) comes from the whole batch, so a token's output "
                             f"would change with the other tokens; pass {name}, or quantize per token "
                             f"(per_act_token_quant=True) or per block (block_shape)")


def check_no_grad_inplace(hidden_states: torch.Tensor) -> None:
    """In-place on a tensor that requires grad breaks autograd (torch's in-place ops refuse it)."""
    if hidden_states.requires_grad:
        raise RuntimeError("inplace=True on hidden_states that requires grad: the in-place layer has no backward "
                           "(its input is overwritten); pass inplace=False to train, or run under torch.no_grad()")


# the (PrepareAndFinalize, experts) kinds with a backward
TRAINABLE_PARTS = (("noep", "triton"), ("allgather", "triton"), ("alltoall", "batched_triton"))
# the layer's float inputs its backward gives no gradient: weight and activation scales
NO_GRADIENT = ("w1_scale", "w2_scale", "a1_scale", "a2_scale", "w1_zp", "w2_zp")


def needs_grad(args: LayerArgs) -> bool:
    """Autograd would record this call: grad mode is on and an input tensor requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args)


def check_recorded_call(args: LayerArgs, quant: FusedMoEQuantConfig) -> None:
    """A call autograd records, refused before any launch when its backward would be wrong or
    fail: a scale or zero point that requires grad (the backward gives them none, so it would stay
    None without a word); frozen per-tensor or per-token fp8 experts (the backward dequantizes
    block fp8 and weight-only low-bit codes, which also need the saved pre-activation:
    ``low_bit_needs_saved_preactivation``)."""
    for name in NO_GRADIENT:
        t = getattr(args, name)
        if t is not None and t.requires_grad:
            raise ValueError(f"{name} requires grad, but the layer's backward gives scales and zero points no "
                             f"gradient (its .grad would stay None): pass {name}.detach()")
    if quant.quant_dtype is not None and quant.block_shape is None:
        scheme = str(quant.quant_dtype).removeprefix("torch.")
        raise NotImplementedError(f"gradients through frozen quantized experts ({scheme}) are not supported yet "
                                  "(block fp8 and weight-only int4/int8/mxfp4 are), and this call records autograd "
                                  "(an input requires grad): run the quantized layer under torch.no_grad() or "
                                  "torch.inference_mode(), or train float experts")


def low_bit_needs_saved_preactivation(weight_dtype: str) -> str:
    """The refusal of a recorded call on frozen low-bit experts whose forward does not save its
    pre-activation (its backward reads it: the low-bit GEMMs of the backward are g's and dX's)."""
    return (f"gradients through frozen {weight_dtype} experts read the forward's saved pre-activation: keep "
            "save_preactivation=True (the default) and run TritonExperts behind NoEPPrepareAndFinalize (one device)")


def check_trainable(args: LayerArgs, prepare_finalize: str, experts: str, quant_dtype: str | None,
                    weight_dtype: str | None) -> None:
    """A call that needs gradients runs a layer with a backward: ``TritonExperts`` behind
    ``NoEPPrepareAndFinalize`` (one device) or ``AllGatherPrepareAndFinalize``, or
    ``BatchedTritonExperts`` behind ``AllToAllPrepareAndFinalize`` (with the call's expert_map);
    quantized (fp8, low-bit) weights only frozen. Raises before any launch, naming
    what has no backward. (Frozen quantized experts run forward; their backward raises.)"""
    if (prepare_finalize, experts) not in TRAINABLE_PARTS:
        raise NotImplementedError(
            f"the {prepare_finalize!r} PrepareAndFinalize with {experts!r} experts has no backward; gradients need "
            "TritonExperts behind NoEPPrepareAndFinalize (tmoe.fused_experts' default) or "
            "AllGatherPrepareAndFinalize, BatchedTritonExperts behind AllToAllPrepareAndFinalize, or run under "
            "torch.no_grad()")
    if prepare_finalize == "alltoall" and args.expert_map is None:
        raise ValueError("the all-to-all expert parallelism's backward needs the layer call's expert_map "
                         "(tmoe.modular.placement.expert_map of this rank and the placement)")
    scheme = quant_dtype or weight_dtype
    if scheme is not None and (args.w1.requires_grad or args.w2.requires_grad):
        raise NotImplementedError(f"quantized expert weights ({scheme}) cannot be trained: w1/w2 require grad; train "
                                  "float weights, or freeze them (requires_grad_(False))")


def saves_preactivation(prepare_finalize: str, experts: str, quantized_activations: bool) -> bool:
    """Whether a training call's forward can save its pre-activation for the backward (the layer op
    ``tmoe::modular_forward_train``): ``TritonExperts`` behind ``NoEPPrepareAndFinalize`` with float
    activations (float or weight-only low-bit weights; not ``quantized_activations``: fp8). Other
    trainable calls recompute it in the backward (frozen low-bit experts then refuse)."""
    return (prepare_finalize, experts) == ("noep", "triton") and not quantized_activations


def check_no_overlap(hidden_states: torch.Tensor) -> None:
    """In-place into a tensor whose elements overlap in memory (expanded, stride 0) writes one
    element for several rows (torch's in-place ops refuse it)."""
    if hidden_states.numel() > 1 and torch._debug_has_internal_overlap(hidden_states) == 1:
        raise RuntimeError("inplace=True on hidden_states whose elements overlap in memory (an expanded tensor); "
                           "clone it first, as torch's in-place ops require")


def check_routing(num_experts: int, topk: int, scoring: str, num_expert_group: int, topk_group: int) -> None:
    """A router's options, checked when the layer is built (0 groups: no grouped top-k)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if bool(num_expert_group) != bool(topk_group):
        raise ValueError("num_expert_group and topk_group must be given together")
    if num_expert_group:
        if num_experts % num_expert_group:
            raise ValueError(f"num_expert_group={num_expert_group} must divide num_experts={num_experts}")
        if not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"topk_group must be in [1, num_expert_group={num_expert_group}], got {topk_group}")
        if topk > topk_group * (num_experts // num_expert_group):
            raise ValueError(f"topk={topk} exceeds the {topk_group * (num_experts // num_expert_group)} experts "
                             f"of topk_group groups")
