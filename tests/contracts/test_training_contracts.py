"""Training contracts: a compiled (fullgraph, dynamic) training step equals eager without
recompiling over M; opcheck on every backward op; what has no backward is refused at the forward,
before any launch, naming what is unsupported."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import tmoe
from tmoe.modular.call import LayerArgs
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, half_remote_expert_map, make_problem
from tmoe.testing.tolerance import Tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = Tolerance(rel=1e-5, atol=1e-5, rtol=1e-3)


def _params(e=4, n=40, k=48, seed=0):
    p = make_problem(MoEShape(8, e, n, k, 3), torch.float32, "uniform", seed=seed, device=DEVICE)
    router = torch.randn(e, k, device=DEVICE) / k**0.5
    return [t.detach().clone().requires_grad_() for t in (router, p.w1, p.w2)]


def _step(x, router, w1, w2):
    weights, ids = tmoe.topk_route(x @ router.T, 3)
    return tmoe.fused_experts(x, w1, w2, weights, ids).square().sum()


def test_compiled_training_step_matches_eager_without_recompiles():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_step, backend=counter, fullgraph=True, dynamic=True)
    params = _params()
    for m in (3, 9, 40):
        x = torch.randn(m, 48, device=DEVICE, requires_grad=True)
        eager_grads = torch.autograd.grad(_step(x, *params), [x, *params])
        got_grads = torch.autograd.grad(compiled(x, *params), [x, *params])
        for name, g, r in zip(("x", "router", "w1", "w2"), got_grads, eager_grads):
            assert_close(g, r, TOL, name=f"compiled d{name} (M={m})")
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def _backward_cases():
    p = make_problem(MoEShape(9, 4, 64, 72, 2), torch.float32, "out_of_range", seed=5, device=DEVICE)
    ops = torch.ops.tmoe
    emap = half_remote_expert_map(4, DEVICE)
    sorted_ids, expert_ids, npp, offsets = ops.moe_grad_align(p.topk_ids, 64, 4, None, None)
    go = torch.randn(9, 72, device=DEVICE)
    b1, b2 = torch.randn(4, 128, device=DEVICE), torch.randn(4, 72, device=DEVICE)
    grad_h, inter, partial = ops.moe_grad_act(go, p.x, p.w1, p.w2, p.topk_weights, sorted_ids, expert_ids, npp, 64, b1,
                                              b2, "swigluoai", 1.3, 0.5, True, False)
    act_args = (go, p.x, p.w1, p.w2, p.topk_weights, sorted_ids, expert_ids, npp, 64, b1, b2, "gelu", None, None,
                False, False)
    logits = torch.randn(9, 4, device=DEVICE)
    _, ids = ops.topk_route(logits, 2)
    (q1, s1), (q2, s2) = (tmoe.quantize_weight_per_block_fp8(w, (64, 64)) for w in (p.w1, p.w2))  # frozen block fp8
    fp8_act_args = (*act_args[:2], q1, q2, *act_args[4:], s1, s2, [64, 64])
    preact = torch.randn(9 * 2, 128, device=DEVICE)  # the forward's saved pre-activation, row = slot
    return {
        "moe_grad_align": (ops.moe_grad_align, (p.topk_ids, 64, 4, None, None)),
        "moe_grad_align_map": (ops.moe_grad_align, (p.topk_ids, 128, 4, emap, 2)),
        "moe_grad_act": (ops.moe_grad_act, act_args),
        "moe_grad_act_saved": (ops.moe_grad_act, (*act_args, None, None, None, preact)),
        "moe_grad_input": (ops.moe_grad_input, (grad_h, p.w1, partial, p.topk_weights, p.topk_ids, sorted_ids,
                                                expert_ids, npp, 64, 4, None, None, False)),
        "moe_grad_act_fp8": (ops.moe_grad_act, fp8_act_args),
        "moe_grad_input_fp8": (ops.moe_grad_input, (grad_h, q1, partial, p.topk_weights, p.topk_ids, sorted_ids,
                                                    expert_ids, npp, 64, 4, None, None, False, s1, [64, 64])),
        "moe_grad_weight_w1": (ops.moe_grad_weight, (grad_h, p.x, p.topk_weights, sorted_ids, offsets, 4, False,
                                                     False, 64, None)),
        "moe_grad_weight_w2": (ops.moe_grad_weight, (go, inter, p.topk_weights, sorted_ids, offsets, 4, True, False,
                                                     64, None)),
        "moe_grad_weight_transposed": (ops.moe_grad_weight, (go, inter, p.topk_weights, sorted_ids, offsets, 4, True,
                                                             False, 64, None, True)),
        "moe_grad_bias_b1": (ops.moe_grad_bias, (grad_h, p.topk_weights, sorted_ids, offsets, 4, False, False, None)),
        "moe_grad_bias_b2_map": (ops.moe_grad_bias, (go, p.topk_weights, sorted_ids, offsets, 2, True, True, emap)),
        "topk_route_grad": (ops.topk_route_grad, (torch.randn(9, 2, device=DEVICE), logits, ids, "softmax", True,
                                                  1.0)),
    }


# moe_grad_act's outputs are sized for the worst-case padding; rows past num_tokens_post_padded are
# never written (nor read), so eager and traced outputs differ there and the comparison is left out
# opcheck's schema test multiplies the inputs, which torch has no CPU kernel for in float8: the fp8
# cases run the other tests
PARTIAL_OUTPUTS = {"moe_grad_act": ("test_schema", "test_autograd_registration", "test_faketensor"),
                   "moe_grad_act_saved": ("test_schema", "test_autograd_registration", "test_faketensor"),
                   "moe_grad_act_fp8": ("test_autograd_registration", "test_faketensor"),
                   "moe_grad_input_fp8": ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")}


@pytest.mark.parametrize("name", list(_backward_cases()))
def test_opcheck_backward_ops(name):
    op, args = _backward_cases()[name]
    torch.library.opcheck(op, args, **({"test_utils": PARTIAL_OUTPUTS[name]} if name in PARTIAL_OUTPUTS else {}))


def test_opcheck_layer_and_router_autograd():
    p = make_problem(MoEShape(9, 4, 64, 72, 2), torch.float32, "uniform", seed=7, device=DEVICE)
    spec = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts()).spec.as_args()
    args = tuple(LayerArgs(p.x.requires_grad_(), p.w1.requires_grad_(), p.w2, p.topk_weights.requires_grad_(),
                           p.topk_ids))
    torch.library.opcheck(torch.ops.tmoe.modular_forward, (*args, *spec))
    torch.library.opcheck(torch.ops.tmoe.modular_forward_train, (*args, *spec))
    torch.library.opcheck(torch.ops.tmoe.topk_route, (torch.randn(9, 4, device=DEVICE, requires_grad=True), 2))


def _layer_inputs():
    p = make_problem(MoEShape(6, 4, 64, 64, 2), torch.float32, "uniform", seed=1, device=DEVICE)
    return p.x.requires_grad_(), p.w1, p.w2, p.topk_weights, p.topk_ids


def _no_launch(monkeypatch):
    import tmoe.modular.kernel as kernel

    monkeypatch.setattr(kernel.ModularKernel, "run", lambda *a, **k: pytest.fail("a kernel launched"))


def test_batched_composition_refused_with_grad(monkeypatch):
    layer = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(16, 4), tmoe.BatchedTritonExperts(16))
    _no_launch(monkeypatch)
    with pytest.raises(NotImplementedError, match="'batched' PrepareAndFinalize with 'batched_triton' experts has no "
                                                  "backward"):
        layer(*_layer_inputs())


def _fp8_layer_inputs():
    x, w1, w2, tw, ids = _layer_inputs()
    w1q, s1 = tmoe.quantize_weight_per_channel_fp8(w1.detach())
    w2q, s2 = tmoe.quantize_weight_per_channel_fp8(w2.detach())
    qc = tmoe.FusedMoEQuantConfig(quant_dtype=torch.float8_e4m3fn, per_act_token_quant=True, per_out_ch_quant=True)
    return (x, w1q, w2q, tw, ids), dict(quant_config=qc, w1_scale=s1, w2_scale=s2)


def test_quantized_weights_that_require_grad_refused(monkeypatch):
    (x, w1q, w2q, tw, ids), kw = _fp8_layer_inputs()
    _no_launch(monkeypatch)
    with pytest.raises(NotImplementedError, match=r"quantized expert weights \(float8_e4m3fn\) cannot be trained"):
        tmoe.fused_experts(x, w1q.requires_grad_(), w2q, tw, ids, **kw)


def _frozen_quantized(scheme: str):
    """(layer inputs, options) of frozen ``scheme`` experts: fp8 per channel, or int4/int8/mxfp4 codes (group 32)."""
    if scheme == "fp8":
        return _fp8_layer_inputs()
    x, w1, w2, tw, ids = _layer_inputs()
    if scheme == "mxfp4":
        (q1, s1), (q2, s2) = tmoe.quantize_weight_mxfp4(w1), tmoe.quantize_weight_mxfp4(w2)
    else:
        quantize = tmoe.quantize_weight_int4 if scheme == "int4" else tmoe.quantize_weight_int8
        (q1, s1, _), (q2, s2, _) = quantize(w1, 32), quantize(w2, 32)
    qc = tmoe.FusedMoEQuantConfig(weight_dtype=scheme, group_size=32)
    return (x, q1, q2, tw, ids), dict(quant_config=qc, w1_scale=s1, w2_scale=s2)


@pytest.mark.parametrize("scheme", ["fp8", "int4", "int8", "mxfp4"])
def test_frozen_quantized_experts_refused_when_the_forward_records(scheme, monkeypatch):
    """Frozen experts whose backward cannot run, x requiring grad (a trainable layer in front):
    per-channel fp8 (the backward dequantizes block fp8 only), and low-bit codes without the saved
    pre-activation (their backward reads it); refused at the forward, before any launch, not at
    backward() after it ran."""
    (x, w1q, w2q, tw, ids), kw = _frozen_quantized(scheme)
    match = r"frozen quantized experts \(float8_e4m3fn\) are not supported"
    if scheme != "fp8":
        kw, match = dict(kw, save_preactivation=False), rf"frozen {scheme} experts read the forward's saved"
    _no_launch(monkeypatch)
    with pytest.raises(NotImplementedError, match=match):
        tmoe.fused_experts(x, w1q, w2q, tw, ids, **kw)
    monkeypatch.undo()
    with torch.no_grad():  # inference runs
        assert tmoe.fused_experts(x, w1q, w2q, tw, ids, **kw).shape == x.shape


@pytest.mark.parametrize("name", ["w1_scale", "w2_scale"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "only-the-scale"])
def test_scale_that_requires_grad_refused(name, x_grad, monkeypatch):
    """Frozen block-fp8 experts (trainable) with a weight scale that requires grad: the backward
    gives scales no gradient, so the call is refused at the forward instead of leaving .grad None."""
    x, w1, w2, tw, ids = _layer_inputs()
    w1q, s1 = tmoe.quantize_weight_per_block_fp8(w1, (32, 32))
    w2q, s2 = tmoe.quantize_weight_per_block_fp8(w2, (32, 32))
    scales = {"w1_scale": s1, "w2_scale": s2}
    scales[name].requires_grad_()
    qc = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(32, 32))
    _no_launch(monkeypatch)
    with pytest.raises(ValueError, match=f"{name} requires grad, but the layer's backward gives scales"):
        tmoe.fused_experts(x.requires_grad_(x_grad), w1q, w2q, tw, ids, quant_config=qc, **scales)


def test_double_backward_refused():
    """create_graph=True (a gradient penalty): tmoe says its backward is not differentiable."""
    x, w1, w2, tw, ids = _layer_inputs()
    out = tmoe.fused_experts(x, w1, w2, tw, ids)
    with pytest.raises(NotImplementedError, match=r"create_graph=True \(double backward"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)


def _compiled_wrong_shape():
    x, w1, w2, tw, ids = _layer_inputs()
    return torch.compile(tmoe.fused_experts, fullgraph=True)(x.detach(), w1, w2[:, :-1], tw, ids)


def _compiled_batched_with_grad():
    layer = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(16, 4), tmoe.BatchedTritonExperts(16))
    return torch.compile(layer, fullgraph=True)(*_layer_inputs())


def _compiled_frozen_int4():
    (x, w1q, w2q, tw, ids), kw = _frozen_quantized("int4")
    kw = dict(kw, save_preactivation=False)  # the backward of frozen low-bit experts reads the saved pre-activation
    return torch.compile(lambda *a: tmoe.fused_experts(*a, **kw), fullgraph=True)(x, w1q, w2q, tw, ids)


@pytest.mark.parametrize("call, match", [
    (_compiled_wrong_shape, r"^w2 must have shape \(4, 64, 64\), got \(4, 63, 64\)"),
    (_compiled_batched_with_grad, r"^the 'batched' PrepareAndFinalize with 'batched_triton' experts has no backward"),
    (_compiled_frozen_int4, r"^gradients through frozen int4 experts read the forward's saved pre-activation"),
], ids=["fake-check", "no-backward", "frozen-int4"])
def test_compiled_refusals_end_in_tmoe_message(call, match, monkeypatch):
    """Under torch.compile(fullgraph=True) the user reads tmoe's error, not dynamo's "Observed
    exception" or "Dynamo failed to run FX node" with the message inside: the checks run in the
    op's fake and autograd setup, whose errors dynamo re-raises as they are."""
    torch._dynamo.reset()
    _no_launch(monkeypatch)
    with pytest.raises(ValueError, match=match) as raised:
        call()
    assert not isinstance(raised.value, torch._dynamo.exc.TorchDynamoException)
    assert "Observed exception" not in str(raised.value) and "Dynamo failed" not in str(raised.value)


def test_inplace_refused_with_grad():
    with pytest.raises(RuntimeError, match="inplace=True on hidden_states that requires grad"):
        tmoe.fused_experts(*_layer_inputs(), inplace=True)


def test_stage_ops_stay_inference_only():
    p = make_problem(MoEShape(4, 4, 64, 64, 2), torch.float32, "uniform", seed=2, device=DEVICE)
    y = torch.randn(4, 2, 64, device=DEVICE, requires_grad=True)
    out = torch.ops.tmoe.moe_reduce(y, p.topk_ids, 4, p.topk_weights, None)
    with pytest.raises(RuntimeError, match="tmoe::moe_reduce is a stage op without a backward"):
        out.sum().backward()


@pytest.mark.parametrize("save", [True, False])
def test_flop_counter_counts_the_backward(save):
    """FlopCounterMode sees forward and backward: 2·S·K·3N forward, then 2·S·K·N for the
    intermediate's gradient (2·S·K·(N + 2N) with the recomputed pre-activation), 2·S·2N·K for dx,
    2·S·(2N·K + K·N) for dW."""
    from torch.utils.flop_counter import FlopCounterMode

    m, e, n, k, topk = 6, 4, 40, 48, 2
    p = make_problem(MoEShape(m, e, n, k, topk), torch.float32, "uniform", seed=3, device=DEVICE)
    leaves = [t.requires_grad_() for t in (p.x, p.w1, p.w2)]
    with FlopCounterMode(display=False) as counter:
        tmoe.fused_experts(*leaves, p.topk_weights, p.topk_ids, save_preactivation=save).sum().backward()
    s = m * topk
    grad_act = 2 * s * k * (n + (0 if save else 2 * n))
    assert counter.get_total_flops() == 2 * s * k * 3 * n + grad_act + 2 * s * 2 * n * k + 2 * s * 3 * n * k


def test_fp8_backward_ops_name_bad_scales(monkeypatch):
    """The backward ops' block-fp8 arguments are checked before any launch, naming the argument."""
    ops = torch.ops.tmoe
    args = _backward_cases()["moe_grad_act_fp8"][1]
    import tmoe.kernels.moe_grad_act as grad_act

    monkeypatch.setattr(grad_act, "launch", lambda *a, **k: pytest.fail("a kernel launched"))
    q1, q2, s1, s2 = args[2], args[3], args[-3], args[-2]
    with pytest.raises(ValueError, match=r"w1_scale must have shape \(4, 2, 2\)"):
        ops.moe_grad_act(*args[:-3], s1[:, :1], s2, [64, 64])
    with pytest.raises(ValueError, match="fp8 weights need block_shape"):
        ops.moe_grad_act(*args[:-3], s1, s2, None)
    with pytest.raises(TypeError, match="w2 must be float8_e4m3fn"):
        ops.moe_grad_act(*args[:3], q2.float(), *args[4:])
    with pytest.raises(TypeError, match="w1_scale must be a torch.Tensor"):
        ops.moe_grad_act(*args[:-3], None, s2, [64, 64])
    assert q1.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("block_m", [0, 48, -64])
def test_weight_gradient_op_names_a_bad_block_m(block_m, monkeypatch):
    """moe_grad_weight's align block is checked (a positive power of two) before any launch, in the
    op and in its fake."""
    import tmoe.kernels.moe_grad_weight as grad_weight

    monkeypatch.setattr(grad_weight, "launch", lambda *a, **k: pytest.fail("a kernel launched"))
    args = list(_backward_cases()["moe_grad_weight_w2"][1])
    args[8] = block_m
    with pytest.raises(ValueError, match=f"block_m must be the align's block size, a power of two; got {block_m}"):
        torch.ops.tmoe.moe_grad_weight(*args)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match="block_m must be"):
        torch.ops.tmoe.moe_grad_weight(*args)


# case: (backward case, argument index, replacement from the valid arguments, error, message)
BAD_BACKWARD_OPERANDS = {
    "grad_h-columns": ("moe_grad_input", 0, lambda a: a[0][:, :5], ValueError,
                       r"grad_h must have shape \(P=\d+ = len\(sorted_token_ids\)"),
    "grad_h-rows": ("moe_grad_input", 0, lambda a: a[0][:-1], ValueError, "grad_h must have shape"),
    "grad_h-int": ("moe_grad_input", 0, lambda a: a[0].int(), TypeError, "grad_h must have dtype"),
    "grad_h-strided": ("moe_grad_input", 0, lambda a: a[0].t().contiguous().t(), ValueError,
                       "grad_h must be contiguous along its last"),
    "partial-fp16": ("moe_grad_input", 2, lambda a: a[2].half(), TypeError, "partial must have dtype"),
    "partial-rows": ("moe_grad_input", 2, lambda a: a[2][:-1], ValueError, "partial must have P="),
    "input-topk_weights-shape": ("moe_grad_input", 3, lambda a: a[3][:, :1].contiguous(), ValueError,
                                 "topk_weights must have shape"),
    "sorted_token_ids-int64": ("moe_grad_input", 5, lambda a: a[5].long(), TypeError,
                               "sorted_token_ids must have dtype"),
    "num_tokens_post_padded-shape": ("moe_grad_input", 7, lambda a: a[7].repeat(2), ValueError,
                                     "num_tokens_post_padded must have shape"),
    "grad_out-columns": ("moe_grad_act", 0, lambda a: a[0][:, :5], ValueError, "grad_out must have shape"),
    "grad_out-dtype": ("moe_grad_act", 0, lambda a: a[0].double(), TypeError, "grad_out must have dtype"),
    "w1-rows": ("moe_grad_act", 2, lambda a: a[2][:, :5], ValueError, "w1 must have shape"),
    "w2-k": ("moe_grad_act", 3, lambda a: a[3][:, :5], ValueError, "w2 must have shape"),
    "act-topk_weights-rows": ("moe_grad_act", 4, lambda a: a[4][:-1], ValueError,
                              "topk_weights must have one row per token"),
    "act-expert_ids-int64": ("moe_grad_act", 6, lambda a: a[6].long(), TypeError, "expert_ids must have dtype"),
    "w1_bias-shape": ("moe_grad_act", 9, lambda a: a[9][:, :5], ValueError, "w1_bias must have shape"),
    "left-rows": ("moe_grad_weight_w1", 0, lambda a: a[0][:-1], ValueError,
                  r"left must have \d+ rows, one per aligned rows"),
    "right-rows": ("moe_grad_weight_w1", 1, lambda a: a[1][:-1], ValueError, "right must have 9 rows, one per tokens"),
    "right-dtype": ("moe_grad_weight_w1", 1, lambda a: a[1].double(), TypeError, "right must have dtype"),
    "weight-topk_weights-fp16": ("moe_grad_weight_w2", 2, lambda a: a[2].half(), TypeError,
                                 "topk_weights must have dtype"),
    "expert_offsets-int64": ("moe_grad_weight_w2", 4, lambda a: a[4].long(), TypeError,
                             "expert_offsets must have dtype"),
}


@pytest.mark.parametrize("case", list(BAD_BACKWARD_OPERANDS))
def test_backward_ops_name_misshapen_operands(case, monkeypatch):
    """The backward ops check their operands against each other before any launch, in the op and
    in its fake (rows of grad_h, partial and the weight GEMMs' operands against the align's length
    and the tokens, widths against the weights): a narrower grad_h, for one, had run without an
    error, read past its end on the pointer path."""
    import tmoe.kernels.moe_grad_act as grad_act
    import tmoe.kernels.moe_grad_input as grad_input
    import tmoe.kernels.moe_grad_weight as grad_weight

    name, index, bad, error, match = BAD_BACKWARD_OPERANDS[case]
    op, args = _backward_cases()[name]
    for module in (grad_act, grad_input, grad_weight):
        monkeypatch.setattr(module, "launch", lambda *a, **k: pytest.fail("a kernel launched"))
    args = list(args)
    args[index] = bad(args)
    with pytest.raises(error, match=match):
        op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(error, match=match):
        op(*args)


def test_alltoall_backward_needs_the_expert_map():
    """The all-to-all backward finds this rank's experts through the call's expert_map: without
    one, a call that needs gradients is refused at the forward, naming it."""
    from tmoe.modular.checks import check_trainable

    x, w1, w2, tw, ids = _layer_inputs()
    with pytest.raises(ValueError, match="all-to-all expert parallelism's backward needs the layer call's expert_map"):
        check_trainable(LayerArgs(x, w1, w2, tw, ids), "alltoall", "batched_triton", None, None)
    check_trainable(LayerArgs(x, w1, w2, tw, ids, expert_map=torch.arange(4, dtype=torch.int32)), "alltoall",
                    "batched_triton", None, None)
