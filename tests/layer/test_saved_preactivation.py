"""Training's saved pre-activation (``tmoe::modular_forward_train``): the forward's output is the
inference op's, bit for bit, and each slot's row of ``preact`` is x @ w1[e].T (gate columns, then
up; before the router weight and the bias) against float64, on every route that keeps the slots
apart, chunked or not; calls it cannot serve recompute, and wrong arguments raise naming them."""
import pytest
import torch

import tmoe
from tmoe.config import override_route
from tmoe.modular.call import LayerArgs
from tmoe.reference import moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, half_remote_expert_map, make_problem
from tmoe.testing.tolerance import Tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: Tolerance(rel=1e-6, atol=1e-5, rtol=1e-4),
       torch.bfloat16: Tolerance(rel=1e-2, atol=2e-2, rtol=0.05)}


def _preact_reference(x, w1, ids, interleaved: bool = False) -> torch.Tensor:
    """(M * topk, W1 rows) float64: slot t * topk + j is x[t] @ w1[e].T, gate columns then up."""
    h = torch.einsum("mk,mjrk->mjr", x.double(), w1.double()[ids.long()])
    if interleaved:
        h = torch.cat([h[..., 0::2], h[..., 1::2]], dim=-1)
    return h.reshape(ids.numel(), -1)


def _layer_args(m, e, n, k, topk, dtype, activation="silu", bias=False, interleaved=False, seed=0, **options):
    p = make_problem(MoEShape(m, e, n, k, topk), dtype, "uniform", seed=seed, device=DEVICE)
    w1 = p.w1[:, :n].contiguous() if activation.endswith("_no_mul") else p.w1
    g = torch.Generator().manual_seed(seed + 1)
    b1 = (0.5 * torch.randn(e, w1.shape[1], generator=g)).to(dtype).to(DEVICE) if bias else None
    b2 = (0.5 * torch.randn(e, k, generator=g)).to(dtype).to(DEVICE) if bias else None
    return LayerArgs(p.x, w1, p.w2, p.topk_weights, p.topk_ids, activation=activation, w1_bias=b1, w2_bias=b2,
                     gate_up_interleaved=interleaved, **options)


SPEC = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts()).spec.as_args()
CASES = {  # (m, e, n, k, topk, dtype, activation, bias, interleaved, options)
    "silu": (37, 4, 64, 48, 2, torch.float32, "silu", False, False, {}),
    "bf16-bias": (21, 4, 64, 48, 2, torch.bfloat16, "silu", True, False, {}),
    "swigluoai-interleaved": (13, 4, 32, 48, 2, torch.float32, "swigluoai", True, True, {}),
    "relu2_no_mul": (17, 6, 64, 32, 3, torch.float32, "relu2_no_mul", True, False, {}),
    "weight-on-input-bias": (11, 4, 64, 48, 1, torch.float32, "gelu", True, False,
                             dict(apply_router_weight_on_input=True)),
}


@pytest.mark.parametrize("route", ["sorted", "slots", "grouped"])
@pytest.mark.parametrize("case", list(CASES))
def test_saved_preactivation_matches_float64_and_output_is_unchanged(case, route):
    m, e, n, k, topk, dtype, activation, bias, interleaved, options = CASES[case]
    args = _layer_args(m, e, n, k, topk, dtype, activation, bias, interleaved, seed=m, **options)
    with override_route(route):
        out, preact = torch.ops.tmoe.modular_forward_train(*args, *SPEC)
        plain = torch.ops.tmoe.modular_forward(*args, *SPEC)
    assert torch.equal(out, plain), "saving the pre-activation changed the layer's output"
    assert preact.shape == (m * topk, args.w1.shape[1]) and preact.dtype == dtype
    ref = _preact_reference(args.hidden_states, args.w1, args.topk_ids, interleaved)
    assert_close(preact, ref, TOL[dtype], name="preact")  # every row written: the conftest poisons with NaN


def test_chunked_calls_save_each_chunk_rows():
    """Chunks of 5 tokens: each chunk's slots land in their own rows of preact. (Unforced, chunks
    this small take a decode route when nothing is saved, whose top-k sum inside the down GEMM
    rounds differently: the slot route is forced for the bitwise comparison.)"""
    args = _layer_args(23, 4, 64, 48, 2, torch.float32, seed=3)
    spec = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(), chunk_size=5).spec.as_args()
    out, preact = torch.ops.tmoe.modular_forward_train(*args, *spec)
    assert_close(preact, _preact_reference(args.hidden_states, args.w1, args.topk_ids),
                 TOL[torch.float32], name="preact")
    assert_close(out, moe_reference(*args[:5]), TOL[torch.float32], name="out")
    with override_route("slots"):
        assert torch.equal(torch.ops.tmoe.modular_forward_train(*args, *spec)[0],
                           torch.ops.tmoe.modular_forward(*args, *spec))


def test_remote_and_out_of_range_slots_are_never_read():
    """Slots of remote experts (expert_map) and out-of-range ids: the forward leaves their rows of
    preact unwritten (NaN under the conftest's poison) and the backward never reads them, so every
    gradient is finite and the remote slots' router gradients are exactly zero."""
    e = 6
    p = make_problem(MoEShape(9, e, 64, 48, 2), torch.float32, "out_of_range", seed=5, device=DEVICE)
    emap = half_remote_expert_map(e, DEVICE)
    x, w1, w2, tw = (t.clone().requires_grad_() for t in (p.x, p.w1[0::2], p.w2[0::2], p.topk_weights))
    out = tmoe.fused_experts(x, w1, w2, tw, p.topk_ids, global_num_experts=e, expert_map=emap)
    grads = torch.autograd.grad(out, (x, w1, w2, tw), torch.randn_like(out))
    assert all(g.isfinite().all() for g in grads)
    ids = p.topk_ids
    dead = (ids < 0) | (ids >= e) | (ids % 2 == 1)
    assert dead.any() and torch.all(grads[3][dead] == 0)


def test_frozen_fp8_experts_recompute():
    """Frozen block-fp8 experts (x and the router weights train): the recomputing op records the call."""
    args = _layer_args(8, 4, 128, 128, 2, torch.float32)
    (q1, s1), (q2, s2) = (tmoe.quantize_weight_per_block_fp8(w, (128, 128)) for w in (args.w1, args.w2))
    qc = tmoe.FusedMoEQuantConfig(torch.float8_e4m3fn, block_shape=(128, 128))
    out = tmoe.fused_experts(args.hidden_states.requires_grad_(), q1, q2, args.topk_weights, args.topk_ids,
                             quant_config=qc, w1_scale=s1, w2_scale=s2)
    assert out.grad_fn.name() == "GeneratedBackwardFor_tmoe_modular_forward_defaultBackward", out.grad_fn.name()
    spec = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(qc)).spec.as_args()
    with pytest.raises(ValueError, match="float activations"):
        torch.ops.tmoe.modular_forward_train(*args._replace(w1=q1, w2=q2, w1_scale=s1, w2_scale=s2), *spec)


def test_the_default_saves_and_the_keyword_recomputes():
    args = _layer_args(8, 4, 64, 48, 2, torch.float32)
    x = args.hidden_states.requires_grad_()
    for save, op in ((True, "modular_forward_train"), (False, "modular_forward")):
        out = tmoe.fused_experts(x, *args[1:5], save_preactivation=save)
        assert out.grad_fn.name() == f"GeneratedBackwardFor_tmoe_{op}_defaultBackward", out.grad_fn.name()
    kernel = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(), save_preactivation=False)
    assert kernel(x, *args[1:5]).grad_fn.name() == "GeneratedBackwardFor_tmoe_modular_forward_defaultBackward"
    with torch.no_grad():  # inference never saves
        assert tmoe.fused_experts(x, *args[1:5]).grad_fn is None


def test_wrong_arguments_raise_naming_them():
    args = _layer_args(8, 4, 64, 48, 2, torch.float32)
    with pytest.raises(TypeError, match="save_preactivation"):
        tmoe.fused_experts(*args[:5], save_preactivation=1)
    with pytest.raises(TypeError, match="save_preactivation"):
        tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(), save_preactivation="no")
    from tmoe.kernels.grad_checks import check_preact
    x, w1, tw = args.hidden_states, args.w1, args.topk_weights
    with pytest.raises(ValueError, match="preact"):
        check_preact(torch.empty(16, 64, device=DEVICE), x, w1, tw)
    with pytest.raises(TypeError, match="preact"):
        check_preact(torch.empty(16, 128, dtype=torch.float64, device=DEVICE), x, w1, tw)
    with pytest.raises(ValueError, match="preact"):
        check_preact(torch.empty(128, 16, device=DEVICE).t(), x, w1, tw)


def test_replayed_calls_save_into_their_own_buffer():
    """A signature's third call on replays its recorded launches (``tmoe.runtime.replay``): each
    call's preact is its own, on fresh inputs every time."""
    for seed in range(5):
        args = _layer_args(20, 4, 64, 48, 2, torch.float32, seed=seed)
        out, preact = torch.ops.tmoe.modular_forward_train(*args, *SPEC)
        assert_close(preact, _preact_reference(args.hidden_states, args.w1, args.topk_ids),
                     TOL[torch.float32], name=f"preact (call {seed})")
        assert torch.equal(out, torch.ops.tmoe.modular_forward(*args, *SPEC))
