"""tmoe on a machine without a GPU: its kernels run interpreted whatever was imported first, nobody
else's kernels change mode, and threaded callers get right answers (launches are serialized)."""
import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from tmoe.runtime.interpreter import INTERPRETED

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU (interpreted) path")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run_fresh(script: str, path: pathlib.Path) -> str:
    """``script``, written to ``path`` (@triton.jit needs a source file), in a fresh process with
    this checkout's tmoe and no TRITON_INTERPRET set; its stdout."""
    path.write_text(textwrap.dedent(script))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("first", ["torch._dynamo", "triton", "triton.language"])
def test_layer_runs_after_triton_was_imported_first(first, tmp_path):
    """Triton read TRITON_INTERPRET (unset) before tmoe was imported: tmoe's kernels are still
    interpreted and match the reference (the Gluon engine's kernels excepted: they never run
    interpreted, the tl kernels stand in for them); a user's kernel defined after ``import tmoe`` is not."""
    out = _run_fresh(f"""
        import os, sys
        import {first}
        import torch, triton, tmoe
        from triton.runtime.jit import JITFunction
        from triton.runtime.interpreter import InterpretedFunction
        from tmoe.reference import moe_reference
        from tmoe.testing import assert_close
        from tmoe.testing.strategies import MoEShape, make_problem

        p = make_problem(MoEShape(7, 4, 64, 64, 2), torch.float32, "uniform", seed=0)
        out = tmoe.fused_experts(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)
        assert_close(out, moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids), torch.float32)
        from triton.experimental.gluon._runtime import GluonJITFunction  # the Gluon engine: Hopper only, never interpreted
        compiled = [f"{{m.__name__}}.{{k}}" for m in list(sys.modules.values())
                    if getattr(m, "__name__", "").startswith("tmoe.") for k, v in vars(m).items()
                    if isinstance(v, JITFunction) and not isinstance(v, GluonJITFunction)]
        assert not compiled, compiled

        @triton.jit
        def user_kernel(x_ptr):
            pass

        print(type(user_kernel).__name__, os.environ.get("TRITON_INTERPRET"))
    """, tmp_path / "first.py")
    assert out.split() == ["JITFunction", "None"]


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's thread safety")
def test_layer_called_from_four_threads_matches_reference():
    import tmoe
    from tmoe.reference import moe_reference
    from tmoe.testing import assert_close

    layer = tmoe.FusedMoE(4, 64, 32, 2, dtype=torch.float32)
    xs = [torch.randn(5 + i, 64) for i in range(4)]
    outs: list = [None] * 4
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            with torch.no_grad():
                outs[i] = layer(xs[i])
        except BaseException as err:  # reported below, with the thread's index
            errors.append(err)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with torch.no_grad():
        for x, out in zip(xs, outs):
            weights, ids = layer.route(x @ layer.router_weight.T)
            assert_close(out, moe_reference(x, layer.w1, layer.w2, weights, ids), torch.float32)
