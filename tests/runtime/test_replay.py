"""Whole-call replay (``tmoe.runtime.replay``): from the third call of a layer signature on, the
recorded launches run again with the new call's tensors. Each variant is called four times with
fresh inputs of the same shapes (new routing, new weights) and compared with the float32
reference every time; the replay's fresh workspace is poisoned by conftest's torch.empty, so a
launch that a replay skipped or pointed at the wrong memory fails the comparison."""
import contextlib

import pytest
import torch
import triton
import triton.language as tl

import tmoe
from tmoe.config import override_route
from tmoe.runtime import launch as launch_mod, state
from tmoe.runtime.replay import CallReplay
from tmoe.reference import moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, half_remote_expert_map, make_problem
from tests.layer.test_fp8_layer import SCHEMES, run_scheme
from tests.layer.test_low_bit import CASES, run_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CALLS = 4


@pytest.fixture
def replays(monkeypatch):
    """The number of replayed calls so far."""
    count = [0]
    real = CallReplay._replay

    def counted(self, inputs):
        count[0] += 1
        assert not self.keep or not self.steps[0].kernel.fn.__name__.startswith("_moe"), \
            "a layer call kept memory of its own as a constant"  # tmoe's layer caches no tensor
        return real(self, inputs)

    monkeypatch.setattr(CallReplay, "_replay", counted)
    return count


def _layer(variant: str, seed: int):
    """(output, reference) of one call of ``variant`` on fresh inputs."""
    shape = MoEShape(7, 4, 48, 64, 2)
    p = make_problem(shape, torch.float32, "out_of_range", seed=seed, device=DEVICE)
    ref = lambda **kw: moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **kw)  # noqa: E731
    if variant == "bias_swigluoai":
        b1 = torch.randn(shape.e, 2 * shape.n, device=DEVICE) * 0.1
        b2 = torch.randn(shape.e, shape.k, device=DEVICE) * 0.1
        layer = dict(activation="swigluoai", w1_bias=b1, w2_bias=b2, swiglu_alpha=1.5, swiglu_limit=5.0)
        return tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, **layer), ref(**layer)
    if variant == "expert_map":
        emap = half_remote_expert_map(shape.e, DEVICE)
        local = torch.arange(shape.e, device=DEVICE)[emap >= 0]
        w1, w2 = p.w1[local].contiguous(), p.w2[local].contiguous()
        out = tmoe.fused_experts(p.x, w1, w2, p.topk_weights, p.topk_ids, global_num_experts=shape.e, expert_map=emap)
        return out, moe_reference(p.x, w1, w2, p.topk_weights, p.topk_ids, global_num_experts=shape.e,
                                  expert_map=emap)
    if variant == "batched":
        kernel = tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(shape.m * shape.topk, shape.e),
                                            tmoe.BatchedTritonExperts(shape.m * shape.topk))
        return kernel(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), ref()
    if variant in ("chunked", "chunked_inplace"):
        kernel = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(), chunk_size=3)
        expected = ref()
        x = p.x.clone()
        out = kernel(x, p.w1, p.w2, p.topk_weights, p.topk_ids, inplace=variant == "chunked_inplace")
        assert (out.data_ptr() == x.data_ptr()) == (variant == "chunked_inplace")
        return out, expected
    if variant == "shared_weight_storage":  # w1 and w2 views of one buffer in the recorded call only
        if seed == 0:
            flat = torch.cat([p.w1.flatten(), p.w2.flatten()])
            w1, w2 = flat[: p.w1.numel()].view(p.w1.shape), flat[p.w1.numel():].view(p.w2.shape)
        else:
            w1, w2 = p.w1, p.w2
        return tmoe.fused_experts(p.x, w1, w2, p.topk_weights, p.topk_ids), ref()
    with override_route(variant):  # "sorted" or "direct"
        return tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), ref()


@pytest.mark.parametrize("variant", ["sorted", "direct", "bias_swigluoai", "expert_map", "batched", "chunked",
                                     "chunked_inplace", "shared_weight_storage"])
def test_replayed_layer_calls_match_the_reference(variant, replays):
    for seed in range(CALLS):
        out, ref = _layer(variant, seed)
        assert_close(out, ref, torch.float32, name=f"{variant}, call {seed + 1}")
    assert replays[0] == CALLS - 2  # the first call plans, the second records


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_replayed_fp8_calls_match_the_reference(scheme, replays):
    for seed in range(CALLS):
        p = make_problem(MoEShape(5, 4, 128, 256, 2), torch.bfloat16, "uniform", seed=seed, device=DEVICE)
        out, ref = run_scheme(p, scheme)
        assert_close(out, ref, "fp8", name=f"call {seed + 1}")
    assert replays[0] == CALLS - 2


@pytest.mark.parametrize("case", [c for c in CASES if c.shape.m > 0][:3:2] + [CASES[-1]], ids=str)
def test_replayed_low_bit_calls_match_the_reference(case, replays):
    for _ in range(CALLS):
        out, ref = run_case(case)  # the same weights, new activations and routing are not drawn: same seed
        assert_close(out, ref, case.dtype)
    assert replays[0] == CALLS - 2


def test_inplace_and_out_of_place_calls_do_not_share_a_replay(replays):
    """Same shapes, one call in place and one not: the aliasing is part of the signature."""
    shape = MoEShape(6, 4, 32, 64, 2)
    for seed in range(2 * CALLS):
        p = make_problem(shape, torch.float32, "uniform", seed=seed, device=DEVICE)
        ref = moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, inplace=seed % 2 == 1)
        assert_close(out, ref, torch.float32, name=f"call {seed + 1}")
    assert replays[0] == 2 * (CALLS - 2)


@triton.jit
def _scale_kernel(x_ptr, table_ptr, tmp_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(tmp_ptr + offs, tl.load(x_ptr + offs, mask=mask) * tl.load(table_ptr + offs, mask=mask), mask=mask)
    tl.store(out_ptr + offs, tl.load(tmp_ptr + offs, mask=mask) + 1.0, mask=mask)


_TABLE: dict[int, torch.Tensor] = {}  # a cached constant, made before the recorded call


def _composite(x: torch.Tensor, out: torch.Tensor, extra_torch_op: bool = False) -> torch.Tensor:
    if x.numel() not in _TABLE:
        _TABLE[x.numel()] = torch.arange(x.numel(), dtype=torch.float32, device=x.device)
    table = _TABLE[x.numel()]
    tmp = torch.empty_like(x)  # a workspace: allocated by the call
    if extra_torch_op:
        x = x * 2  # device work that is not a Triton launch
    launch_mod.launch(_scale_kernel, (1,), x, table, tmp, out, x.numel(), BLOCK=16)
    return out


@pytest.mark.parametrize("extra_torch_op", [False, True])
def test_replay_keeps_constants_and_refuses_other_device_work(extra_torch_op, replays):
    replay = CallReplay()
    for _ in range(CALLS):
        x = torch.randn(10, device=DEVICE)
        out = torch.empty(10, device=DEVICE)
        assert replay.run((out, x), lambda: _composite(x, out, extra_torch_op)) is out
        factor = 2 if extra_torch_op else 1
        torch.testing.assert_close(out, x * factor * torch.arange(10.0, device=DEVICE) + 1, rtol=0, atol=1e-6)
    assert (replay.steps is None) == extra_torch_op  # a torch op in the call: never replayed
    assert replays[0] == (0 if extra_torch_op else CALLS - 2)
    if not extra_torch_op:
        kinds = sorted(src[0] for step in replay.steps for _, src in step.sources)
        assert len(replay.keep) == 1 and replay.arena_bytes == 256  # the table kept, tmp in the arena
        assert len(kinds) == 4


def test_clearing_the_launch_caches_records_again(replays):
    replay = CallReplay()
    x, out = torch.randn(10, device=DEVICE), torch.empty(10, device=DEVICE)
    for _ in range(3):
        replay.run((out, x), lambda: _composite(x, out))
    assert replays[0] == 1
    state.clear_launch_caches()
    for _ in range(2):
        replay.run((out, x), lambda: _composite(x, out))
    assert replays[0] == 1 and replay.steps is not None  # planned and recorded afresh, not replayed
    replay.run((out, x), lambda: _composite(x, out))
    assert replays[0] == 2


@contextlib.contextmanager
def _through_triton():
    """A launch hook installed: launches go through Triton's own path and nothing is replayed."""
    knobs = triton.knobs.runtime
    saved = knobs.launch_enter_hook
    knobs.launch_enter_hook = lambda *args: None
    try:
        yield
    finally:
        knobs.launch_enter_hook = saved


@pytest.mark.gpu
@pytest.mark.parametrize("m,tma", [(1, False), (8, False), (300, False), (300, True)])
def test_gpu_replay_is_bit_exact_and_captures(m, tma, replays):
    """On the GPU a replay calls the compiled kernels with integer addresses (and rebuilt TMA
    descriptors): every replayed call equals Triton's own launch of the same call bit for bit,
    and a CUDA graph captured after replayed calls (the capture itself takes the plain path)
    gives the eager result for new routing."""
    from tmoe.config import GemmConfig, MoEConfig, override_config
    from tmoe.testing.graphs import capture_cuda_graph

    e, n, k, topk = 16, 256, 512, 4
    w1 = torch.randn(e, 2 * n, k, dtype=torch.bfloat16, device="cuda") * 0.05
    w2 = torch.randn(e, k, n, dtype=torch.bfloat16, device="cuda") * 0.05
    config = MoEConfig(GemmConfig(64, 64, 64, tma=True), GemmConfig(64, 64, 64, tma=True)) if tma else None
    with override_config(config) if tma else contextlib.nullcontext():
        for call in range(CALLS):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            w, ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
            out = tmoe.fused_experts(x, w1, w2, w, ids.int())
            with _through_triton():
                expected = tmoe.fused_experts(x, w1, w2, w, ids.int())
            assert torch.equal(out, expected), f"call {call + 1}"
            assert_close(out, moe_reference(x, w1, w2, w, ids.int()), torch.bfloat16)
        assert replays[0] == CALLS - 2
        graph, out = capture_cuda_graph(lambda: tmoe.fused_experts(x, w1, w2, w, ids.int()))
        for _ in range(2):
            w.copy_(torch.rand_like(w))
            ids.copy_(torch.randint(0, e, ids.shape, device="cuda"))
            x.copy_(torch.randn_like(x))
            graph.replay()
            with _through_triton():
                assert torch.equal(out, tmoe.fused_experts(x, w1, w2, w, ids.int()))
