"""The intermediate's gradient (``moe_grad_act``) on each of its paths, and the M-grouped GEMM that
its ``g_first`` path runs first (``sorted_input_grad``), against float64.

``sorted_input_grad`` alone: every aligned row of a local expert's block equals d_row @ w[e] in
float64; rows it must not write (past the padded length, remote experts') keep their NaN.
``moe_grad_act``'s paths (fused TMA, fused pointer, g_first on TMA and on pointers, each
recomputing the pre-activation; and the forward's saved pre-activation) through the layer: every
gradient against float64 autograd of the reference."""
import functools

import pytest
import torch

import tmoe
import tmoe.kernels.moe_grad_act as grad_act_module
import tmoe.kernels.moe_grad_input as grad_input_module
from tmoe.kernels.align import moe_align_block_size
from tmoe.config import override_backward_tiles
from tmoe.kernels.grad_config import ActTiles, InputTiles
from tmoe.kernels.moe_grad_input import sorted_input_grad
from tmoe.testing import assert_close
from tmoe.testing.gradients import layer_grads, reference_grads
from tmoe.testing.strategies import MoEShape, half_remote_expert_map, make_problem
from tmoe.testing.tolerance import Tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INPUT_TILES = {"tma": InputTiles(32, 32, 4, 2), "pointer": InputTiles(32, 32, 4, 2, tma=False)}
TOL = {torch.float32: Tolerance(rel=1e-6, atol=1e-5, rtol=1e-4),
       torch.bfloat16: Tolerance(rel=1e-2, atol=2e-2, rtol=0.05)}
# each gradient against float64 (as tests/layer/test_backward.py): bf16 also rounds g to bf16 on the g_first path
GRAD_TOL = {torch.float32: Tolerance(rel=1e-5, atol=1e-5, rtol=1e-3),
            torch.bfloat16: Tolerance(rel=2e-2, atol=2e-2, rtol=0.1)}


@pytest.mark.parametrize("path", list(INPUT_TILES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, e, routing, remote, skip_remote", [
    (37, 4, "skewed", False, False), (29, 6, "uniform", True, True), (29, 6, "uniform", True, False),
    (23, 6, "out_of_range", False, True), (1, 4, "uniform", False, False),
], ids=str)
def test_sorted_input_grad_matches_float64(path, dtype, m, e, routing, remote, skip_remote, monkeypatch):
    """``skip_remote=False`` flattens the persistent tile loop (uniform K loop): remote blocks then
    run their K loop on zeros and must still write nothing."""
    r_dim, c_dim, topk, block_m = 40, 72, 2, 32
    p = make_problem(MoEShape(m, e, 8, 8, topk), dtype, routing, seed=m + e, device=DEVICE)
    g = torch.Generator().manual_seed(m)
    expert_map = half_remote_expert_map(e, DEVICE) if remote else None
    e_local = (e + 1) // 2 if remote else e
    offsets = torch.empty(e + 1, dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, npp = moe_align_block_size(p.topk_ids, block_m, e, expert_map, offsets,
                                                       num_local_experts=e_local if remote else None)
    rows = sorted_ids.shape[0]
    d = torch.randn(rows, r_dim, generator=g).to(dtype).to(DEVICE)
    d[sorted_ids >= m * topk] = 0.0  # the aligned copy's padding rows
    w = (torch.randn(e_local, r_dim, c_dim, generator=g) / r_dim**0.5).to(dtype).to(DEVICE)
    launched = []  # (the output is allocated NaN-poisoned by conftest: unwritten rows stay NaN)
    launch = grad_input_module.launch
    monkeypatch.setattr(grad_input_module, "launch",
                        lambda k, *a, **kw: (launched.append(a[1]), launch(k, *a, **kw))[1])
    out = sorted_input_grad(d, w, sorted_ids, expert_ids, npp, m * topk, block_m=block_m, tiles=INPUT_TILES[path],
                            skip_remote=skip_remote)
    assert (type(launched[-1]) is torch.Tensor) == (path == "pointer"), "the TMA path loads w by its descriptor"
    assert out.shape == (rows, c_dim) and out.dtype == dtype
    expert_of_row = expert_ids.long().repeat_interleave(block_m)[:rows].cpu()
    written = (torch.arange(rows) < int(npp)) & (expert_of_row >= 0)
    want = torch.einsum("pr,prc->pc", d.cpu().double(), w.cpu().double()[expert_of_row.clamp(min=0)])
    assert_close(out.cpu()[written], want[written], TOL[dtype], name="da")
    assert out.cpu()[~written].isnan().all(), "rows past the padded length or of remote experts were written"
    assert written.any()


# the paths of moe_grad_act, forced through the layer's backward at both align blocks; "saved"
# reads the forward's pre-activation (g first, rows by pointers, whatever the tiles say)
PATHS = {"fused-tma": ActTiles(128, 32, 8, 4), "fused-pointer": ActTiles(tma=False),
         "g_first-tma": ActTiles(64, 64, 8, 3, g_first=True), "g_first-pointer": ActTiles(64, 64, 8, 3, tma=False,
                                                                                              g_first=True),
         "saved": ActTiles(128, 32, 8, 4)}
CASES = {  # (m, e, n, k, topk, activation, options, bias, dtype)
    "silu": (33, 4, 48, 40, 2, "silu", {}, False, torch.float32),
    "bf16-bias": (19, 4, 48, 40, 2, "silu", {}, True, torch.bfloat16),
    "swigluoai-interleaved-bias": (9, 4, 48, 40, 2, "swigluoai",
                                   dict(swiglu_alpha=1.3, swiglu_limit=0.8, gate_up_interleaved=True), True,
                                   torch.float32),
    "on-input": (7, 4, 48, 40, 1, "gelu", dict(apply_router_weight_on_input=True), False, torch.float32),
    "no-mul-64-row-blocks": (21, 20, 48, 40, 2, "relu2_no_mul", {}, True, torch.float32),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_every_path_gives_float64_gradients(path, case, monkeypatch):
    m, e, n, k, topk, activation, options, bias, dtype = CASES[case]
    launched = []
    launch = grad_act_module.launch
    monkeypatch.setattr(grad_act_module, "launch", lambda kern, grid, *a, **kw: (launched.append(kw),
                                                                                   launch(kern, grid, *a, **kw))[1])
    p = make_problem(MoEShape(m, e, n, k, topk), dtype, "uniform", seed=m, device=DEVICE)
    w1 = p.w1[:, :n].contiguous() if activation.endswith("_no_mul") else p.w1
    g = torch.Generator().manual_seed(m + 1)
    rand = lambda *s: (0.5 * torch.randn(*s, generator=g)).to(dtype).to(DEVICE)  # noqa: E731
    inputs = dict(hidden_states=p.x, w1=w1, w2=p.w2, topk_weights=p.topk_weights, topk_ids=p.topk_ids,
                  w1_bias=rand(e, w1.shape[1]) if bias else None, w2_bias=rand(e, k) if bias else None)
    for t in inputs.values():
        if t is not None and t.is_floating_point():
            t.requires_grad_()
    grad_out = torch.randn(m, k, device=DEVICE).to(dtype)
    opts = dict(activation=activation, **options)
    save = path == "saved"
    with override_backward_tiles(act=PATHS[path]):
        grads = layer_grads(functools.partial(tmoe.fused_experts, save_preactivation=save), inputs, grad_out, **opts)
    ref = reference_grads(inputs, grad_out, **opts)
    for name, got in grads.items():
        assert_close(got, ref[name], GRAD_TOL[dtype], name=f"d{name}")
    saved = save
    tma = PATHS[path].tma and not options.get("gate_up_interleaved") and not saved
    expected = (PATHS[path].g_first or saved, tma, saved)
    assert [(kw["G_FIRST"], kw["TMA"], kw["SAVED"]) for kw in launched] == [expected], launched
