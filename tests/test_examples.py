"""The examples run (tiny sizes) and agree with the stock model."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def test_tiny_mixtral_example_runs():
    path = Path(__file__).parent.parent / "examples" / "tiny_mixtral.py"
    spec = importlib.util.spec_from_file_location("tiny_mixtral", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(tiny=True, new_tokens=3)
    assert results["greedy tokens equal (fraction)"] > 0.5
