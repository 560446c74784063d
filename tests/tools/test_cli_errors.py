"""The command line answers a newcomer: ``demo --help`` prints usage, ``tune`` on CPU says it needs a GPU."""
import subprocess
import sys

import pytest
import torch


def _tmoe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tmoe", *args], capture_output=True, text=True, timeout=300)


def test_demo_help_prints_usage():
    run = _tmoe("demo", "--help")
    assert run.returncode == 0 and "usage: python -m tmoe demo" in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_tune_on_cpu_says_it_needs_a_gpu():
    run = _tmoe("tune")
    assert run.returncode == 2 and "needs a CUDA device" in run.stderr and "Traceback" not in run.stderr
