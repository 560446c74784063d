"""tmoe's Triton-interpreter workarounds (tmoe/runtime/interpreter.py): on by default for tmoe's
launches, gone for everybody else's, and each one still needed by the interpreter in use."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import triton
import triton.language as tl

import tmoe
from tmoe.runtime.interpreter import INTERPRETED, interpreter_fixes
from tmoe.reference import moe_reference
from tmoe.testing import assert_close
from tmoe.testing.strategies import MoEShape, make_problem

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="workarounds for Triton's CPU interpreter")
ROOT = pathlib.Path(__file__).resolve().parents[2]


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tile = offs[:, None] * N + offs[None, :]  # [N, N]
    tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))


@triton.jit
def _k_loop_kernel(a_ptr, b_ptr, c_ptr, M, K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k, offs_n = tl.arange(0, BLOCK_K), tl.arange(0, N)
    acc = tl.zeros((BLOCK_M, N), tl.float32)  # [BM, N]
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + offs_m[:, None] * K + k + offs_k[None, :], mask=offs_m[:, None] < M, other=0.0)
        acc = tl.dot(a, tl.load(b_ptr + (k + offs_k[:, None]) * N + offs_n[None, :]), acc)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=offs_m[:, None] < M)


@triton.jit
def _cast_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(y_ptr.dtype.element_ty))


@triton.jit
def _scalar_mask_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    keep = tl.load(x_ptr) >= 0  # a scalar comparison broadcast into a block mask
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=(offs < N) & keep, other=0.0))


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, tl.exp(x - tl.max(x, axis=0)))


def _dot_ok(dtype: torch.dtype) -> bool:
    a, b = torch.randn(16, 16).to(dtype), torch.randn(16, 16).to(dtype)
    a[3, 5] = float("nan")  # row 3 of the product is NaN on a GPU
    c = torch.zeros(16, 16)
    _dot_kernel[(1,)](a, b, c, N=16)
    ref = a.float() @ b.float()
    return bool(c[3].isnan().all()) and torch.allclose(c[torch.arange(16) != 3], ref[torch.arange(16) != 3], rtol=1e-5)


def _cast_ok(dtype: torch.dtype) -> bool:
    """fp32 -> ``dtype`` as a GPU casts: nearest even, fp8 saturating (``cvt.rn.satfinite``), NaN kept."""
    x = torch.cat([torch.tensor([124.3, float("nan"), 1000.0, -float("inf")]), torch.randn(508) * 100])
    y = torch.zeros(512, dtype=dtype)
    _cast_kernel[(1,)](x, y, N=512)
    if dtype.itemsize == 1:
        big = torch.finfo(dtype).max
        return bool((y.view(torch.uint8) == x.clamp(-big, big).to(dtype).view(torch.uint8)).all())
    return bool((y.view(torch.int16) == x.to(dtype).view(torch.int16)).all())


def _scalar_mask_ok() -> bool:
    x, y = torch.arange(8.0), torch.zeros(8)
    try:
        _scalar_mask_kernel[(1,)](x, y, N=8)
    except triton.runtime.errors.InterpreterError:
        return False
    return bool((y == x).all())


def _quiet_ok() -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        try:
            _softmax_kernel[(1,)](torch.full((8,), float("-inf")), torch.zeros(8), N=8)
        except triton.runtime.errors.InterpreterError as err:
            assert isinstance(err.__cause__, RuntimeWarning), err
            return False
    return True


FAULTS = {
    "bf16 dot": lambda: _dot_ok(torch.bfloat16),
    "fp8 dot keeps NaN": lambda: _dot_ok(torch.float8_e4m3fn),
    "fp32->bf16 rounds to nearest even": lambda: _cast_ok(torch.bfloat16),
    "fp32->fp8 rounds with carry, keeps NaN": lambda: _cast_ok(torch.float8_e4m3fn),
    "scalar comparison as a mask": _scalar_mask_ok,
    "no numpy RuntimeWarning": _quiet_ok,
}


@pytest.fixture(scope="module")
def fault_results() -> dict[str, list[bool]]:
    """Each check on the bare interpreter and inside ``interpreter_fixes``, in a fresh process
    (an earlier test may have installed the fixes process-wide with ``patch_interpreter``)."""
    out = _run(textwrap.dedent(f"""
        import importlib.util, json
        from tmoe.runtime.interpreter import interpreter_fixes
        spec = importlib.util.spec_from_file_location("faults", {str(pathlib.Path(__file__))!r})
        faults = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(faults)
        results = {{}}
        for name, check in faults.FAULTS.items():
            bare = check()
            with interpreter_fixes():
                results[name] = [bare, check()]
        print(json.dumps(results))
    """))
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("fault", FAULTS)
def test_each_workaround_is_needed_and_works(fault, fault_results):
    """The bare interpreter still has the fault (when this fails, Triton fixed it: drop the
    workaround); inside ``interpreter_fixes`` the result is the GPU's."""
    bare, fixed = fault_results[fault]
    assert not bare, f"Triton {triton.__version__}'s interpreter no longer needs the '{fault}' workaround"
    assert fixed


def _run(script: str) -> str:
    """Run ``script`` in a fresh interpreter (nothing patched yet) with this checkout's tmoe; its stdout."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_default_bf16_layer_matches_reference_in_fresh_process():
    _run(textwrap.dedent("""
        import torch, tmoe
        from tmoe.reference import moe_reference
        from tmoe.testing import assert_close
        from tmoe.testing.strategies import MoEShape, make_problem
        p = make_problem(MoEShape(9, 4, 64, 64, 2), torch.bfloat16, "uniform", seed=0)
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
        assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), torch.bfloat16)
    """))


_USER_KERNELS = textwrap.dedent("""
    import torch, triton, triton.language as tl
    from triton.runtime import interpreter as interp

    @triton.jit
    def user_dot(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tile = offs[:, None] * N + offs[None, :]
        tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))

    @triton.jit
    def user_cast(x_ptr, y_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))

    def user_results():
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(16, 16, generator=g).bfloat16(), torch.randn(16, 16, generator=g).bfloat16()
        x = torch.randn(256, generator=g)
        c, y = torch.zeros(16, 16), torch.zeros(256, dtype=torch.bfloat16)
        user_dot[(1,)](a, b, c, N=16)
        user_cast[(1,)](x, y, N=256)
        return a.float() @ b.float(), c, y

    def interpreter_functions():
        return (interp._convert_float, interp.InterpreterBuilder.create_dot, interp.InterpreterBuilder.create_icmpSGE,
                interp._patch_lang)
""")


def test_user_kernels_see_the_bare_interpreter_after_tmoe_calls():
    """A plain @triton.jit kernel computes exactly what it computed before tmoe ran (the bare
    interpreter's bf16 dot and truncating cast), and the interpreter's functions are the originals."""
    _run(_USER_KERNELS + textwrap.dedent("""
        originals, (true_dot, dot, cast) = interpreter_functions(), user_results()
        assert not torch.allclose(dot, true_dot, rtol=0.1)  # the bare interpreter's bf16 dot
        import tmoe
        from tmoe.testing.strategies import MoEShape, make_problem
        p = make_problem(MoEShape(5, 4, 64, 64, 2), torch.bfloat16, "uniform", seed=0)
        tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
        tmoe.topk_route(torch.randn(5, 4), 2)
        assert interpreter_functions() == originals
        _, dot_after, cast_after = user_results()
        assert torch.equal(dot_after.view(torch.int32), dot.view(torch.int32))
        assert torch.equal(cast_after.view(torch.int16), cast.view(torch.int16))
    """))


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's language patching")
def test_launch_patches_the_language_once_per_kernel(monkeypatch):
    """Inside a tmoe launch the jit helpers reuse their kernel's patching of triton.language: one
    walk of its modules per kernel launch, where the bare interpreter walks them at every helper call."""
    from triton.runtime import interpreter as interp

    walks, launches = [], []
    patch_builtin, run = interp._patch_builtin, interp.GridExecutor.__call__
    monkeypatch.setattr(interp, "_patch_builtin", lambda *a: walks.append(1) or patch_builtin(*a))
    monkeypatch.setattr(interp.GridExecutor, "__call__", lambda self, *a, **k: launches.append(1) or run(self, *a, **k))
    p = make_problem(MoEShape(9, 4, 64, 64, 2), torch.float32, "uniform", seed=0)
    out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)  # kernels calling helpers per program
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), torch.float32)
    per_launch = len(walks) / len(launches)
    assert per_launch <= 6, f"{len(walks)} walks of triton.language in {len(launches)} launches"


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's dtype table")
def test_remembered_numpy_dtypes_are_the_interpreters():
    """Inside a launch the numpy dtype of each Triton type (scalar, block, pointer) is the one the
    interpreter's own table gives."""
    from triton.runtime import interpreter as interp

    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
               tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    types = scalars + [tl.block_type(t, [4, 2]) for t in scalars] + [tl.pointer_type(tl.float32),
                                                                      tl.block_type(tl.pointer_type(tl.bfloat16), [8])]
    original = interp._get_np_dtype
    want = [original(t) for t in types]
    with interpreter_fixes():
        assert interp._get_np_dtype is not original  # the remembering twin is in place
        got = [interp._get_np_dtype(t) for t in types] + [interp._get_np_dtype(t) for t in types]
    assert got == want + want


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's overflow sanitizer")
def test_launches_run_without_the_overflow_sanitizer(monkeypatch):
    """tmoe's launches skip the interpreter's int32 overflow checks (a GPU build runs none without
    debug=True) and give the reference's results; other kernels keep the checks."""
    from triton.language import semantic
    from triton.runtime import interpreter as interp

    checks, check = [], semantic.TritonSemantic.binary_op_sanitize_overflow_impl
    monkeypatch.setattr(semantic.TritonSemantic, "binary_op_sanitize_overflow_impl",
                        lambda self, *a: checks.append(self.builder.options.sanitize_overflow) or check(self, *a))
    p = make_problem(MoEShape(9, 4, 64, 64, 2), torch.float32, "uniform", seed=0)
    out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), torch.float32)
    assert checks and not any(checks), "a launch checked int32 overflow"
    assert interp.interpreter_builder.options.sanitize_overflow


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's reductions")
def test_sort_reduces_its_xors_with_numpy(monkeypatch):
    """The align's sorting program (``tl.sort``: xor reductions in every compare-and-swap) runs no
    reduction element by element, and sorts exactly as the three-launch path does."""
    from triton.runtime import interpreter as interp

    from tmoe.kernels import align
    from tmoe.runtime.state import clear_launch_caches

    slow, generic = [], interp.ReduceOps.generic_reduce
    monkeypatch.setattr(interp.ReduceOps, "generic_reduce", lambda self, x: slow.append(1) or generic(self, x))
    ids = torch.randint(0, 16, (300, 4), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    outs = []
    for sort_max in (0, 4096):
        monkeypatch.setattr(align, "SORT_MAX_SLOTS", sort_max)
        clear_launch_caches()
        outs.append(tmoe.moe_align_block_size(ids, 16, 16))
    clear_launch_caches()
    assert not slow, f"{len(slow)} reductions ran element by element"
    for chunks, sort in zip(*outs):
        assert torch.equal(chunks, sort)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_row_stays_in_its_row(dtype, route):
    """A NaN in one token's input makes that token's output NaN and no other (as on a GPU)."""
    p = make_problem(MoEShape(7, 4, 64, 64, 2), dtype, "uniform", seed=3)
    p.x[2, 5] = float("nan")
    out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
    assert bool(out[2].isnan().all())
    assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), dtype)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_topk_route_prints_no_numpy_warning(scoring):
    logits = torch.randn(9, 6)
    logits[1] = float("-inf")
    logits[2, 3] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tmoe.topk_route(logits, 2, scoring=scoring)
        tmoe.topk_route(logits, 2, scoring=scoring, num_expert_group=2, topk_group=1,
                        e_score_correction_bias=torch.zeros(6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dot_rows_do_not_depend_on_the_tile(dtype):
    """A K loop's row is the same bits whatever the other rows, the row's place in the tile, the
    tile's M extent and block_k (the interpreter's BLAS sgemm sums a row in a position-dependent order
    and rounds once per K tile; a GPU chains the products into the accumulator in ascending k)."""
    g = torch.Generator().manual_seed(0)
    b = torch.randn(128, 32, generator=g).to(dtype)
    probe = torch.randn(1, 128, generator=g).to(dtype)
    results = []
    for m, row, block_m, block_k in ((1, 0, 16, 128), (5, 3, 16, 16), (40, 37, 32, 64), (70, 9, 64, 32)):
        a = torch.randn(m, 128, generator=g).to(dtype)
        a[row] = probe[0]
        c = torch.zeros(m, 32)
        with interpreter_fixes():
            _k_loop_kernel[(triton.cdiv(m, block_m),)](a, b, c, m, K=128, N=32, BLOCK_M=block_m, BLOCK_K=block_k)
        results.append(c[row])
    assert all(torch.equal(r, results[0]) for r in results)
    assert_close(results[0], (probe.double() @ b.double())[0].float(), torch.float32)
