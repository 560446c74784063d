"""``python -m tmoe bench-train --tiny``: the training benchmark runs end to end (on CPU under the
interpreter; peers that need CUDA are reported in their cell) and writes its table and CSV."""
import csv

from tmoe.tools import bench_train


def test_bench_train_tiny_writes_table_and_csv(tmp_path, capsys):
    assert bench_train.main(["--tiny", "--providers", "tmoe,grouped_mm,liger", "--out", str(tmp_path),
                             "--rep-ms", "5", "--commit", "test"]) == 0
    printed = capsys.readouterr().out
    assert "| shape | M | provider | fwd+bwd ms |" in printed
    rows = list(csv.DictReader((tmp_path / "bench_train.csv").open()))
    assert [(r["M"], r["provider"]) for r in rows] == [
        (m, p) for m in ("8", "16") for p in ("tmoe", "grouped_mm", "liger[pinned]")]
    assert all(r["commit"] == "test" and r["shape"] == "tiny" for r in rows)
    tmoe_rows = [r for r in rows if r["provider"] == "tmoe"]
    assert all(float(r["fwd_bwd_ms"]) > 0 and float(r["floor_ms"]) > 0 for r in tmoe_rows)
    assert all(r["graph_ms"] == "n/a" for r in rows)  # no CUDA graphs on CPU
    for r in rows:
        if r["provider"] == "grouped_mm" and r["max_rel_err"] != "n/a":  # _grouped_mm may lack a CPU kernel
            assert float(r["max_rel_err"]) < 5e-2
