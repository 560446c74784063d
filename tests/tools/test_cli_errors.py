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


COMMANDS = [line.split()[0] for line in __import__("tmoe.__main__", fromlist=["USAGE"]).USAGE.splitlines()[2:]
            if line.startswith("  ") and not line.startswith("   ")]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_listed_command_answers_help(command, capsys):
    from tmoe.__main__ import main

    try:
        code = main([command, "-h"])
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "usage" in out.out and "unknown command" not in out.err
