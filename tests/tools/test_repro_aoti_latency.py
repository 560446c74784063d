"""bench/repro_aoti_latency.py runs (``--tiny``: CPU, small shapes) and prints its table."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the lead's (full shapes)")
def test_aoti_latency_tiny_prints_three_rows():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "bench/repro_aoti_latency.py", "--tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert "AOTI package ms" in lines[1] and [line.split()[0] for line in lines[2:]] == ["1", "3", "8"]
