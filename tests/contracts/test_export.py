"""torch.export + AOTInductor: every composition (NoEP, Batched, each fp8 and low-bit scheme,
FusedMoE with its router, a Mixtral block after replace_moe_blocks) exports with a dynamic M, and
its package, loaded in a fresh process, matches eager at three M (``export_cases.py``)."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(HERE / "export_cases.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    return proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU package here; the GPU run is bench/repro_aoti_latency.py")
def test_aoti_package_matches_eager_in_fresh_process(tmp_path):
    _run("compile", str(tmp_path))  # one process exports and compiles every composition (one C++ build)
    assert "ok 10 compositions" in _run("load", str(tmp_path))


def test_empty_int_lists_travel_as_none():
    """An AOTInductor package passes an empty ``int[]`` as None: the spec never sends an empty list."""
    import tmoe

    spec = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts()).spec
    args = spec.as_args()
    assert args[1] is None and args[4] is None
    assert type(spec).from_args(*args) == spec
