"""The command line answers a newcomer: ``demo --help`` prints usage, ``tune`` on CPU says it needs a GPU,
every command's help names it as typed with a whole description, and no command writes into the
checkout unless told where."""
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


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "demo"])
def test_help_names_the_command_and_describes_it_whole(command, capsys):
    from tmoe.__main__ import main

    with pytest.raises(SystemExit):
        main([command, "-h"])
    usage, description = capsys.readouterr().out.split("\n\n")[:2]
    assert usage.startswith(f"usage: python -m tmoe {command} ")
    assert description.rstrip().endswith("."), f"description cut mid-sentence: {description!r}"


def test_bench_commands_write_only_where_told():
    """bench, bench-train, bench-hf append to a CSV only with --csv (bench's report and plot only
    with --out); tune writes its table into the current directory unless --out names another."""
    from tmoe.tools import bench, bench_hf, bench_train, tune

    a = bench.parse_args([])
    assert a.csv is None and a.out is None
    assert bench_train.parse_args([]).csv is None
    assert bench_hf.parse_args([]).csv is None
    assert tune.parse_args(["--shape", "qwen3"]).out == "."
    assert str(bench.parse_args(["--csv", "bench/results/bench_moe.csv"]).csv) == "bench/results/bench_moe.csv"
