"""``tmoe.runtime.launch.launch``: the direct call of a compiled kernel after the first launch of
an argument signature; ``tmoe.runtime.plan``: planned launchers and launch sequences. On CPU the
GPU branch is driven with a fake kernel; on a GPU the layer's launches are checked to take it,
with results equal to the reference."""
import pytest
import torch

import tmoe
from tmoe.config import override_route
from tmoe.runtime import launch as launch_mod, state
from tmoe.runtime import plan as plan_mod
from tmoe.reference import moe_reference
from tmoe.testing import assert_close


class FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *args):
        self.log.append(("direct", (gx, gy, gz), args))


class FakeKernel:
    """A @triton.jit stand-in: kernel[grid](*args, **kwargs) binds by name and returns a compiled kernel."""

    arg_names = ["a_ptr", "b_ptr", "n", "BLOCK"]

    def __init__(self):
        self.log, self.compiles = [], 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiles += 1
            bound = dict(zip(self.arg_names, args), **{k: v for k, v in kwargs.items() if k in self.arg_names})
            self.log.append(("triton", tuple(grid), tuple(bound[n] for n in self.arg_names)))
            return FakeCompiled(self.log)
        return run


@pytest.fixture
def gpu_branch(monkeypatch):
    monkeypatch.setattr(state, "DIRECT_CALLS", True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    state.clear_launch_caches()
    yield
    state.clear_launch_caches()


def test_second_launch_of_a_signature_calls_the_compiled_kernel(gpu_branch):
    kernel = FakeKernel()
    a, b = torch.zeros(64), torch.zeros(64)
    launch_mod.launch(kernel, (3,), a, b_ptr=b, n=5, BLOCK=16, num_warps=4)
    launch_mod.launch(kernel, (3,), a, b_ptr=b, n=5, BLOCK=16, num_warps=4)
    assert kernel.compiles == 1
    assert kernel.log[1] == ("direct", (3, 1, 1), (a, b, 5, 16))  # parameter order, launch options left out


@pytest.mark.parametrize("change", ["n", "BLOCK", "num_warps", "dtype", "alignment"])
def test_a_new_signature_goes_through_triton(gpu_branch, change):
    kernel = FakeKernel()
    buf = torch.zeros(64)
    base = dict(a=buf[:32], b=buf[32:], n=5, BLOCK=16, num_warps=4)
    launch_mod.launch(kernel, (1,), base["a"], b_ptr=base["b"], n=base["n"], BLOCK=base["BLOCK"],
                      num_warps=base["num_warps"])
    new = dict(base)
    if change == "dtype":
        new["a"] = buf[:32].double()
    elif change == "alignment":
        new["a"] = buf[1:33]  # 4-byte offset: Triton specializes pointers on 16-byte alignment
    else:
        new[change] = {"n": 6, "BLOCK": 32, "num_warps": 8}[change]
    launch_mod.launch(kernel, (1,), new["a"], b_ptr=new["b"], n=new["n"], BLOCK=new["BLOCK"], num_warps=new["num_warps"])
    assert kernel.compiles == 2 and kernel.log[1][0] == "triton"


def test_a_launch_hook_keeps_tritons_path(gpu_branch):
    import triton

    kernel = FakeKernel()
    hook = triton.knobs.runtime.launch_enter_hook  # a HookChain (3.6+): set when it holds calls
    hook.add(print)
    try:
        for _ in range(2):
            launch_mod.launch(kernel, (1,), torch.zeros(4), b_ptr=torch.zeros(4), n=1, BLOCK=16)
    finally:
        hook.remove(print)
    assert kernel.compiles == 2
    for _ in range(2):
        launch_mod.launch(kernel, (1,), torch.zeros(4), b_ptr=torch.zeros(4), n=1, BLOCK=16)
    assert kernel.compiles == 3


def _planned_launcher(kernel, bodies):
    @plan_mod.planned
    def launcher(a, b, n, *, derived=False):
        bodies.append(n)
        if n == 0:
            return b
        return plan_mod.Launch(kernel, (2,), dict(a_ptr=a * 2 if derived else a, b_ptr=b, n=n, BLOCK=16), b)
    return launcher


def test_planned_body_runs_once_per_signature(gpu_branch):
    kernel, bodies = FakeKernel(), []
    launcher = _planned_launcher(kernel, bodies)
    a1, b1, a2, b2 = torch.zeros(8), torch.zeros(8), torch.ones(8), torch.ones(8)
    assert launcher(a1, b1, 3) is b1
    assert launcher(a2, b2, 3) is b2  # same signature: no body, the new tensors launched
    assert bodies == [3] and kernel.compiles == 1
    assert kernel.log[1] == ("direct", (2, 1, 1), (a2, b2, 3, 16))
    launcher(a1, b1, 4)  # an int changed: the body again
    launcher(torch.zeros(9), b1, 4)  # a shape changed
    launcher(a1.double(), b1, 4)  # a dtype changed
    launcher(torch.zeros(12)[1:9], b1, 4)  # the alignment changed
    assert bodies == [3, 4, 4, 4, 4] and kernel.compiles == 5
    assert launcher(a1, b1, 0) is b1 and launcher(a1, b1, 0) is b1  # nothing launched: not planned
    assert bodies[-2:] == [0, 0]


def test_planned_body_with_a_tensor_of_its_own_runs_every_call(gpu_branch):
    kernel, bodies = FakeKernel(), []
    launcher = _planned_launcher(kernel, bodies)
    a, b = torch.ones(8), torch.zeros(8)
    for _ in range(2):
        launcher(a, b, 3, derived=True)
    assert bodies == [3, 3] and kernel.compiles == 1  # the body each call, its launch the direct call
    assert kernel.log[1][0] == "direct" and kernel.log[1][2][0].tolist() == [2.0] * 8


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["sorted", "direct"])
def test_layer_launches_take_the_direct_call_and_stay_exact(route):
    """Repeated calls with new routing (and a misaligned input view) through the direct call
    give what Triton's own launch gives, bit for bit, and match the reference."""
    e, n, k, topk = 16, 128, 256, 4
    w1 = torch.randn(e, 2 * n, k, dtype=torch.bfloat16, device="cuda") * 0.05
    w2 = torch.randn(e, k, n, dtype=torch.bfloat16, device="cuda") * 0.05
    with override_route(route):
        for m, offset in ((5, 0), (5, 0), (5, 1), (5, 0), (33, 0)):
            buf = torch.randn(m * k + 8, dtype=torch.bfloat16, device="cuda")
            x = buf[offset: offset + m * k].view(m, k)
            w, ids = torch.topk(torch.randn(m, e, device="cuda").softmax(-1), topk)
            out = tmoe.fused_experts(x, w1, w2, w, ids.int())
            state.clear_launch_caches()
            via_triton = tmoe.fused_experts(x, w1, w2, w, ids.int())
            assert torch.equal(out, via_triton)
            assert_close(out, moe_reference(x, w1, w2, w, ids.int()), torch.bfloat16)
            tmoe.fused_experts(x, w1, w2, w, ids.int())
            direct = tmoe.fused_experts(x, w1, w2, w, ids.int())
            assert torch.equal(direct, via_triton)
    assert state.direct_call_count() >= 2


def _counting_static(monkeypatch):
    calls = []
    real = plan_mod._static

    def static(v):
        calls.append(1)
        return real(v)

    monkeypatch.setattr(plan_mod, "_static", static)
    return calls


def test_layer_replays_its_launches_without_launcher_keys(monkeypatch, device):
    """The second call of a layer signature replays the recorded plans (no per-launcher key);
    new routing, a route override and a new shape still give the reference's result."""
    e, n, k, topk, m = 4, 32, 64, 2, 5
    w1 = torch.randn(e, 2 * n, k, device=device) * 0.1
    w2 = torch.randn(e, k, n, device=device) * 0.1
    calls = _counting_static(monkeypatch)

    def check(m_):
        x = torch.randn(m_, k, device=device)
        w, ids = torch.topk(torch.randn(m_, e, device=device).softmax(-1), topk)
        out = tmoe.fused_experts(x, w1, w2, w, ids.int())
        assert_close(out, moe_reference(x, w1, w2, w, ids.int()), torch.float32)

    check(m)
    assert calls
    calls.clear()
    check(m)
    assert not calls  # replayed
    for route in ("direct", "sorted"):
        with override_route(route):  # a config state of its own: recorded afresh, then replayed
            check(m)
            assert calls
            calls.clear()
            check(m)
            assert not calls
    check(m + 1)
    assert calls
    calls.clear()
    state.clear_launch_caches()  # recorded sequences are dropped with the plans
    check(m + 1)
    assert calls


def test_launch_sequence_mismatch_falls_back_to_keys(gpu_branch):
    kernel, bodies = FakeKernel(), []
    first, second = _planned_launcher(kernel, bodies), _planned_launcher(kernel, bodies)
    a, b = torch.zeros(8), torch.zeros(8)
    seq = plan_mod.LaunchSequence()
    with seq.active():
        first(a, b, 3)
    assert seq.recorded and seq.valid
    with seq.active():
        first(a, b, 3)  # replayed: no body
    assert bodies == [3]
    with seq.active():
        second(a, b, 3)  # another launcher at step 0: the sequence is dropped, keys used
    assert not seq.valid and bodies == [3, 3]
    with seq.active():
        first(a, b, 4)
    assert bodies == [3, 3, 4]
