"""``python -m tmoe bench-train --tiny``: the training benchmark runs end to end (on CPU under the
interpreter, peers that need CUDA reported in their cell; on a GPU host on the GPU) and writes its
table and CSV."""
import csv
from pathlib import Path

import torch

from tmoe.tools import bench_train


def test_bench_train_tiny_writes_table_and_csv(tmp_path, capsys):
    assert bench_train.main(["--tiny", "--providers", "tmoe,grouped_mm,liger", "--csv", str(tmp_path / "bench_train.csv"),
                             "--rep-ms", "5", "--commit", "test"]) == 0
    printed = capsys.readouterr().out
    assert "| shape | M | provider | fwd+bwd ms |" in printed
    rows = list(csv.DictReader((tmp_path / "bench_train.csv").open()))
    assert [(r["M"], r["provider"]) for r in rows] == [
        (m, p) for m in ("8", "16") for p in ("tmoe", "grouped_mm", "liger[pinned]")]
    assert all(r["commit"] == "test" and r["shape"] == "tiny" for r in rows)
    tmoe_rows = [r for r in rows if r["provider"] == "tmoe"]
    assert all(float(r["fwd_bwd_ms"]) > 0 and float(r["floor_ms"]) > 0 for r in tmoe_rows)
    if torch.cuda.is_available():  # Liger's step reads a count on the host: no graph
        assert all((r["graph_ms"] == "n/a") == (r["provider"] == "liger[pinned]") for r in rows)
    else:
        assert all(r["graph_ms"] == "n/a" for r in rows)  # no CUDA graphs on CPU
    for r in rows:
        if r["provider"] == "grouped_mm" and r["max_rel_err"] != "n/a":  # _grouped_mm may lack a CPU kernel
            assert float(r["max_rel_err"]) < 5e-2


def test_bench_train_without_csv_writes_nothing(tmp_path, monkeypatch, capsys):
    """No --csv: the table is printed and no file is written, neither in the working directory nor
    in a checkout's tracked bench/results."""
    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    before = {p: p.stat().st_mtime_ns for p in results.iterdir()} if results.is_dir() else {}
    monkeypatch.chdir(tmp_path)
    assert bench_train.main(["--tiny", "--providers", "tmoe", "--rep-ms", "5", "--commit", "test"]) == 0
    assert "| shape | M | provider | fwd+bwd ms |" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    assert ({p: p.stat().st_mtime_ns for p in results.iterdir()} if results.is_dir() else {}) == before
