"""bench/repro_forward_profile.py's report: ncu's raw CSV (with the run's cell lines mixed in) to
per-cell kernel lines, the largest stall reasons first; a CSV without the metrics is refused."""
import csv
import importlib.util
import io
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("repro_forward_profile", ROOT / "bench" / "repro_forward_profile.py")
profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile)


def _raw_csv(kernels: list[tuple[str, dict[str, str]]]) -> str:
    header = ["ID", "Process ID", "Kernel Name", *profile.METRICS]
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(header)
    w.writerow(["", "", "", *(["unit"] * len(profile.METRICS))])
    for i, (name, values) in enumerate(kernels):
        w.writerow([str(i), "1", name, *(values.get(m, "0") for m in profile.METRICS)])
    return out.getvalue()


def test_report_groups_kernels_by_cell_and_ranks_stalls(tmp_path):
    stall = profile.STALL.format
    gemm = {"gpu__time_duration.sum": "1,250,000", "sm__throughput.avg.pct_of_peak_sustained_elapsed": "57.5",
            "dram__throughput.avg.pct_of_peak_sustained_elapsed": "66.1", stall("barrier"): "2.9",
            stall("long_scoreboard"): "4.4", stall("wait"): "1.8", stall("selected"): "1.0"}
    reduce = {"gpu__time_duration.sum": "9,800", "dram__throughput.avg.pct_of_peak_sustained_elapsed": "52.2"}
    fill = "void at::vectorized_elementwise_kernel<4, at::FillFunctor<float>>(int, T2, T3)"
    text = ("==PROF== Connected\nCELL mixtral bf16 1024\nCELL qwen3 bf16 4096\n"
            + _raw_csv([(fill, {}), ("_grouped_gemm_kernel", gemm), (fill, {}), ("_moe_reduce_kernel", reduce)]))
    path = tmp_path / "ncu.csv"
    path.write_text(text)
    lines = profile.report(path)
    assert lines[0] == "== mixtral bf16 1024" and lines[2] == "== qwen3 bf16 4096"
    assert lines[1].startswith("_grouped_gemm_kernel") and "1250.0 us" in lines[1] and "SM  57.5%" in lines[1]
    assert lines[1].endswith("stalls/issue  10.1: long_scoreboard 4.4, barrier 2.9, wait 1.8")
    assert "9.8 us" in lines[3] and "DRAM  52.2%" in lines[3]


def test_report_refuses_a_csv_without_the_metrics(tmp_path):
    path = tmp_path / "ncu.csv"
    path.write_text('"ID","Kernel Name","Duration"\n"0","k","1"\n')
    with pytest.raises(ValueError, match="gpu__time_duration.sum"):
        profile.report(path)
    path.write_text("CELL qwen3 bf16 4096\n")
    with pytest.raises(ValueError, match="no ncu CSV rows"):
        profile.report(path)
