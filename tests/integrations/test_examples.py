"""The examples run (tiny sizes) and agree with the stock model."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def test_tiny_mixtral_example_runs(capsys):
    path = Path(__file__).resolve().parents[2] / "examples" / "tiny_mixtral.py"
    spec = importlib.util.spec_from_file_location("tiny_mixtral", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(tiny=True, new_tokens=3)
    assert results["greedy tokens equal, stock vs tmoe generate"] > 0.5
    assert results["greedy tokens equal, stock vs tmoe StaticCache"] > 0.5
    # Same model and kernels; the StaticCache decode only adds masked (zero-weight) key slots, so
    # every greedy token must match generate's: a miss means wrong positions or a wrong mask.
    assert results["greedy tokens equal, tmoe StaticCache vs generate"] == 1.0
    # each result prints as it is measured (a long CPU run shows progress), once
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("stock generate ms/token") for line in lines) == 1
    assert lines.index(next(x for x in lines if x.startswith("stock generate"))) < lines.index(
        next(x for x in lines if x.startswith("tmoe generate")))
