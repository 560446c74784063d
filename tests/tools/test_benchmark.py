"""The benchmark harness's pure parts on CPU: roofline math, table, CSV, arguments, and the
plain-PyTorch peers against the reference. No timings."""
import csv
import sys

import pytest
import torch

import tmoe
from tmoe.tools import bench as bm
from tmoe.tools import inputs, peers, results, stage_calls, timing
from tmoe.reference import moe_reference
from tmoe.testing.tolerance import rel_error

# E=4, N=8, K=16, topk=2 at M=3 with 3 experts touched, by hand: weights 3 experts * 3NK = 1152
# elements, activations 2 * M * K = 96 elements, so 2496 bf16 bytes; flops 2 * M * topk * 3NK = 4608.
SMALL = inputs.Shape("small", e=4, n=8, k=16, topk=2)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def on_device():
    """Tensors made without a device land where tmoe's kernels run in this process."""
    with torch.device(DEVICE):
        yield


def test_layer_traffic_by_hand():
    nbytes, flops = bm.layer_traffic(SMALL, m=3, touched=3)
    assert nbytes == 3 * (2 * 8 * 16 + 16 * 8) * 2 + (3 * 16 + 3 * 16) * 2 == 2496
    assert flops == 2 * 3 * 2 * (2 * 8 * 16 + 8 * 16) == 4608
    fp8_bytes, fp8_flops = bm.layer_traffic(SMALL, m=3, touched=3, weight_bytes=1)
    assert fp8_bytes == 1152 + 192 and fp8_flops == flops


def test_stages_add_up_to_the_layer():
    up_b, up_f = bm.stage_traffic("up", SMALL, 3, 3)
    down_b, down_f = bm.stage_traffic("down", SMALL, 3, 3)
    assert up_b == 3 * 256 * 2 + (3 * 16 + 6 * 8) * 2 == 1728 and up_f == 4 * 6 * 8 * 16 == 3072
    assert down_b == 3 * 128 * 2 + 6 * (8 + 16) * 2 == 1056 and down_f == 2 * 6 * 8 * 16 == 1536
    assert up_f + down_f == bm.layer_traffic(SMALL, 3, 3)[1]
    assert bm.stage_traffic("align", SMALL, 3, 3) == (48, 0.0)
    assert bm.stage_traffic("reduce", SMALL, 3, 3) == ((6 + 3) * 16 * 2 + 48, 2.0 * 6 * 16)


def test_floor_is_the_slower_ceiling():
    assert bm.floor_us(2496, 4608, copy_bw=1e9, flop_rate=1e10) == pytest.approx(2.496)  # bandwidth bound
    assert bm.floor_us(2496, 4608, copy_bw=1e9, flop_rate=1e8) == pytest.approx(46.08)  # compute bound


def test_count_touched():
    ids = torch.tensor([[0, 2], [2, 3], [0, 3]], dtype=torch.int32)
    assert bm.count_touched(ids, 4) == 3
    assert bm.count_touched(torch.zeros(0, 2, dtype=torch.int32), 4) == 0


def test_real_shapes():
    assert inputs.SHAPES["deepseek"].max_m == 4096
    mixtral_bytes, _ = bm.layer_traffic(inputs.SHAPES["mixtral"], m=1, touched=2)
    assert mixtral_bytes == 2 * 3 * 14336 * 4096 * 2 + 2 * 4096 * 2  # two experts, ~704 MB


def _row(graph, eager, provider="tmoe"):
    return results.Row(SMALL, "bf16", 3, provider, graph, eager, floor=5.0, nbytes=2e6, flops=4e9, touched=3.0)


def test_row_uses_graph_time_then_eager():
    r = _row(10.0, 12.0)
    assert r.best_us == 10.0
    assert results.row_cells(r) == ["small", "3", "tmoe", "10.0", "12.0", "5.0", "0.50", "0.20", "400.0"]
    syncing = results.row_cells(_row("syncs", 20.0, "loop"))
    assert syncing[3] == "n/a (syncs)" and syncing[6] == "0.25"
    failed = results.row_cells(_row("RuntimeError", "RuntimeError", "grouped_mm"))
    assert failed[3:5] == ["n/a (RuntimeError)"] * 2 and failed[6:] == ["n/a"] * 3


def test_markdown_table():
    lines = results.markdown_table([_row(10.0, 12.0), _row("syncs", 20.0, "loop")]).splitlines()
    assert lines[0] == "| shape | M | provider | graph µs | eager µs | floor µs | fraction of floor | TB/s | TFLOP/s |"
    assert lines[1] == "|" + "---|" * 9
    assert lines[3] == "| small | 3 | loop | n/a (syncs) | 20.0 | 5.0 | 0.25 | 0.10 | 200.0 |"
    assert all(line.count("|") == 10 for line in lines)


def test_csv_appends_rows_under_one_header(tmp_path):
    env = results.Env("2025-01-01T00:00:00", "NVIDIA H200", "2.11.0", "3.6.0", "abc1234")
    path = tmp_path / "bench_moe.csv"
    results.append_csv(path, [_row(10.0, 12.0)], env)
    results.append_csv(path, [_row("syncs", 20.0, "loop")], env)
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == results.CSV_FIELDS and len(rows) == 2
    assert rows[0]["gpu"] == "NVIDIA H200" and rows[0]["commit"] == "abc1234" and rows[0]["E"] == "4"
    assert rows[0]["graph_us"] == "10.0" and rows[0]["fraction"] == "0.50" and rows[0]["touched_experts"] == "3"
    assert rows[1]["provider"] == "loop" and rows[1]["graph_us"] == "n/a (syncs)"


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    assert not results.write_plot(tmp_path / "roofline.png", [_row(10.0, 12.0)])
    assert not (tmp_path / "roofline.png").exists()


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [results.Row(SMALL, "bf16", m, "tmoe", 10.0 * m, 12.0, 5.0, 1.0, 1.0, 3.0) for m in (1, 8, 64)]
    assert results.write_plot(tmp_path / "roofline.png", rows)
    assert (tmp_path / "roofline.png").stat().st_size > 0


def test_parse_args():
    a = bm.parse_args([])
    assert [s.name for s in a.shapes] == ["mixtral", "qwen3", "deepseek"] and a.ms == list(bm.DEFAULT_MS)
    assert a.dtype == "bf16" and a.loop_max_m == 1024 and a.providers == bm.PROVIDERS
    assert bm.parse_args(["--quick"]).ms == list(bm.QUICK_MS)
    a = bm.parse_args(["--shapes", "qwen3", "--ms", "1,8", "--dtype", "fp8_block", "--out", "/tmp/x", "--csv",
                       "/tmp/x/rows.csv", "--stages"])
    assert [s.name for s in a.shapes] == ["qwen3"] and a.ms == [1, 8] and a.dtype == "fp8_block"
    assert str(a.out) == "/tmp/x" and str(a.csv) == "/tmp/x/rows.csv" and a.stages
    assert bm.parse_args(["--providers", "scaled_grouped_mm"]).providers == ("scaled_grouped_mm",)
    for bad in (["--shapes", "llama"], ["--providers", "cublas"], ["--dtype", "fp4"]):
        with pytest.raises(SystemExit):
            bm.parse_args(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU exit path")
def test_main_needs_cuda(capsys):
    assert bm.main(["--quick"]) == 1
    assert "CUDA" in capsys.readouterr().out


def test_git_commit_is_a_string():
    assert isinstance(bm.git_commit(), str) and bm.git_commit()


@pytest.mark.parametrize("m, e, topk", [(5, 4, 2), (1, 4, 1), (7, 3, 3)])
def test_peers_match_reference(m, e, topk):
    n, k = 8, 16
    w1, w2 = torch.randn(e, 2 * n, k) / 4, torch.randn(e, k, n) / 3
    x = torch.randn(m, k)
    weights, ids = torch.topk(torch.randn(m, e).softmax(-1), topk)
    ids = ids.to(torch.int32)
    if m > 1:
        ids[ids == e - 1] = 0  # leave the last expert empty (with duplicate ids in a row when topk > 1)
    ref = moe_reference(x, w1, w2, weights, ids)
    grouped = peers.grouped_mm_moe(x, w1.transpose(1, 2), w2.transpose(1, 2), weights, ids)
    torch.testing.assert_close(grouped, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(peers.loop_moe(x, w1, w2, weights, ids), ref, rtol=1e-5, atol=1e-5)


def test_bf16_providers_select_by_name():
    w1, w2 = torch.randn(2, 16, 16, dtype=torch.bfloat16), torch.randn(2, 16, 8, dtype=torch.bfloat16)
    got = peers.bf16_providers(w1, w2, ("grouped_mm", "loop"))
    assert [(p.name, p.syncs) for p in got] == [("grouped_mm", False), ("loop", True)]


def test_failing_provider_reports_the_error_type():
    p = inputs.Provider("tmoe", peers.failing(ImportError("no quant module")))
    assert bm.guarded(lambda: p.fn(None)) == "ImportError"


REAL_SCALED_GROUPED_MM = torch._scaled_grouped_mm  # kept for its meta checks, before any patch


def _scaled_grouped_mm_stand_in(a, b, scale_a, scale_b, offs=None, out_dtype=None):
    """Float ``torch._scaled_grouped_mm`` (2D x 3D, row-wise scales): the real op's meta checks on
    meta copies (dtypes, shapes, row-/column-major strides, 16-byte alignment), then per-group matmuls."""
    meta = [t.to("meta") for t in (a, b, scale_a, scale_b, offs)]
    assert all(m.stride() == t.stride() for m, t in zip(meta, (a, b))), "meta copies must keep the strides"
    REAL_SCALED_GROUPED_MM(*meta[:4], offs=meta[4], out_dtype=out_dtype)
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=out_dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = (a[start:end].float() * scale_a[start:end, None]) @ (b[g].float() * scale_b[g])
        start = end
    return out


@pytest.mark.parametrize("mode", peers.FP8_MODES)
@pytest.mark.parametrize("m, e, topk", [(9, 4, 2), (1, 4, 1), (7, 3, 3)])
def test_scaled_grouped_mm_peer_matches_reference(monkeypatch, mode, m, e, topk):
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_stand_in)
    n, k = 16, 32  # the GPU op wants 16-byte aligned fp8 rows: N, K multiples of 16
    torch.manual_seed(m * 100 + e)
    w1 = (torch.randn(e, 2 * n, k) / k**0.5).bfloat16()
    w2 = (torch.randn(e, k, n) / n**0.5).bfloat16()
    x = torch.randn(m, k, dtype=torch.bfloat16)
    weights, ids = torch.topk(torch.randn(m, e).softmax(-1), topk)
    ids = ids.to(torch.int32)
    if m > 1:
        ids[ids == e - 1] = 0  # leave the last expert empty
    (peer,) = peers.providers(mode, w1, w2, ("scaled_grouped_mm", "grouped_mm", "loop"))
    assert peer.name == "scaled_grouped_mm" and not peer.syncs
    out = peer.fn(inputs.RoutedInputs(x, weights, ids))
    (w1q, s1), (w2q, s2) = (peers.quantize_fp8(w, "fp8_token") for w in (w1, w2))
    ref = moe_reference(x.float(), w1q.float() * s1, w2q.float() * s2, weights, ids)  # on the dequantized weights
    assert out.dtype == torch.bfloat16 and out.shape == (m, k)
    assert rel_error(out, ref) < 6e-2  # about 4e-2: activations rounded to fp8 twice


def test_providers_by_dtype():
    w1, w2 = torch.randn(2, 32, 16, dtype=torch.bfloat16), torch.randn(2, 16, 16, dtype=torch.bfloat16)
    assert [p.name for p in peers.providers("bf16", w1, w2, bm.PROVIDERS)] == ["tmoe", "grouped_mm", "loop"]
    for mode in peers.FP8_MODES:
        assert [p.name for p in peers.providers(mode, w1, w2, bm.PROVIDERS)] == ["tmoe", "scaled_grouped_mm"]
        assert [p.name for p in peers.providers(mode, w1, w2, ("tmoe",))] == ["tmoe"]


def test_with_routes_forces_the_path_inside_the_call():
    import tmoe.config

    seen = []
    probe = inputs.Provider("tmoe", lambda r: seen.append(tmoe.config.use_direct_route(4096, 8)))
    other = inputs.Provider("grouped_mm", lambda r: None)
    out = peers.with_routes([probe, other], ("auto", "sorted", "direct"))
    assert [p.name for p in out] == ["tmoe", "tmoe[sorted]", "tmoe[direct]", "grouped_mm"]
    for p in out[:3]:
        p.fn(None)
    assert seen == [False, False, True]
    with pytest.raises(SystemExit):
        bm.parse_args(["--routes", "sideways"])


def test_batch_invariant_runs_tmoe_in_the_mode():
    from tmoe.config.invariant import batch_invariant_requested

    seen = []
    probe = inputs.Provider("tmoe", lambda r: seen.append(batch_invariant_requested()))
    other = inputs.Provider("grouped_mm", lambda r: seen.append(batch_invariant_requested()))
    out = peers.batch_invariant(peers.with_routes([probe, other], ("auto", "sorted")))
    assert [p.name for p in out] == ["tmoe[invariant]", "tmoe[sorted][invariant]", "grouped_mm"]
    for p in out:
        p.fn(None)
    assert seen == [True, True, False]
    assert bm.parse_args(["--batch-invariant"]).batch_invariant and not bm.parse_args([]).batch_invariant


def test_scaled_grouped_mm_setup_failure_is_reported(monkeypatch):
    def broken(w, mode):
        raise MemoryError("no room for fp8 weights")

    monkeypatch.setattr(peers, "quantize_fp8", broken)
    w1, w2 = torch.randn(2, 32, 16, dtype=torch.bfloat16), torch.randn(2, 16, 16, dtype=torch.bfloat16)
    (p,) = peers.providers("fp8_block", w1, w2, ("scaled_grouped_mm",))
    assert p.name == "scaled_grouped_mm" and bm.guarded(lambda: p.fn(None)) == "MemoryError"


@pytest.mark.usefixtures("on_device")
@pytest.mark.parametrize("block, tiles, warps", [(64, 16, 8), (128, 4, 8), (256, 1, 8), (512, 1, 16), (1024, 1, 32)])
def test_read_ceiling_kernel_reads_every_element_once(block, tiles, warps):
    """Each read-kernel shape (small stand-ins for ``_READ_SHAPES``) sums every element exactly once."""
    x = torch.randn(3 * block * tiles + 5, dtype=torch.float64).float()
    partials = torch.full((-(-x.numel() // (block * tiles)),), float("nan"))
    timing._stream_read(x, partials, block, tiles, warps)
    assert torch.allclose(partials.double().sum(), x.double().sum(), rtol=1e-5, atol=1e-3)


def test_ceilings_line_names_the_best_and_every_trial():
    c = timing.Ceilings(4.2e12, 4.6e12, 7.9e14, 1.4e15, {"copy": (4.1e12, 4.2e12), "read": (4.6e12, 4.5e12),
                                                  "bf16": (7.8e14, 7.9e14), "fp8": (1.3e15, 1.4e15)}, "note")
    line = c.describe()
    assert "copy 4.20 TB/s, read 4.60 TB/s, bf16 matmul 790 TFLOP/s, fp8 matmul 1400 TFLOP/s" in line
    assert "best of 2" in line and "copy 4.10, 4.20" in line and "fp8 1300.00, 1400.00" in line


def test_low_bit_floor_counts_the_scheme_bytes():
    """int4 (group 128, zero points): a quarter of bf16's weight bytes plus scales and zero points."""
    from tmoe.tools.low_bit import value_bytes

    assert value_bytes("int4") == 0.5 + 2.5 / 128 and value_bytes("mxfp4") == 0.5 + 1 / 32
    assert value_bytes("int8") == 1 + 2 / 128 and value_bytes("bf16") == 2
    bf16, _ = bm.layer_traffic(SMALL, m=3, touched=3)
    int4, _ = bm.layer_traffic(SMALL, m=3, touched=3, weight_bytes=value_bytes("int4"))
    acts = 2 * 3 * SMALL.k * 2
    assert int4 - acts == pytest.approx((bf16 - acts) * value_bytes("int4") / 2)
    assert bm.parse_args(["--dtype", "mxfp4"]).dtype == "mxfp4"


@pytest.mark.usefixtures("on_device")
@pytest.mark.parametrize("dtype", ["int4", "int8", "mxfp4"])
def test_low_bit_providers_match_reference(dtype):
    from tmoe.tools.low_bit import low_bit_providers
    from tmoe.tools.inputs import RoutedInputs

    e, n, k, m, topk = 4, 32, 128, 3, 2
    w1, w2 = torch.randn(e, 2 * n, k) / k**0.5, torch.randn(e, k, n) / n**0.5
    weights, ids = torch.topk(torch.randn(m, e).softmax(-1), topk)
    r = RoutedInputs(torch.randn(m, k), weights, ids.int())
    low_bit, full = low_bit_providers(w1, w2, dtype, ("tmoe",))
    assert (low_bit.name, full.name) == ("tmoe", "tmoe_bf16")
    ref = moe_reference(r.x, w1, w2, r.topk_weights, r.topk_ids)
    assert rel_error(full.fn(r), ref) < 1e-5
    assert rel_error(low_bit.fn(r), ref) < (0.2 if dtype != "int8" else 0.02)  # the weights' own rounding


@pytest.mark.gpu
def test_ceilings_take_the_best_trial_of_each_kind():
    """On the GPU: every ceiling is the best of its recorded trials; bf16 the best of steady and burst."""
    c = timing.measure_ceilings(with_fp8=False, trials=2)
    assert len(c.trials["read"]) == 2 * len(timing._READ_SHAPES) and len(c.trials["bf16 burst"]) == 2
    assert c.read_bw == max(c.trials["read"]) and c.copy_bw == max(c.trials["copy"]) > 0
    assert c.bf16_flops == max(c.trials["bf16"] + c.trials["bf16 burst"]) and c.fp8_flops == 2 * c.bf16_flops


@pytest.mark.usefixtures("on_device")
@pytest.mark.parametrize("mode", ["fp8_block", "fp8_token"])
def test_fp8_stage_calls_chain_to_the_layer(mode):
    """The fp8 stage calls (quantize, align, up, quantize the intermediate, down, reduce), run in
    order, give the layer's output within fp8 rounding of the float32 reference on the
    dequantized weights; every fp8 stage is there."""
    from tmoe.reference import dequantize_fp8_reference

    e, n, k, m, topk = 3, 128, 256, 3, 2
    w1, w2 = torch.randn(e, 2 * n, k) / k**0.5, torch.randn(e, k, n) / n**0.5
    (w1q, s1), (w2q, s2) = peers.quantize_fp8(w1.bfloat16(), mode), peers.quantize_fp8(w2.bfloat16(), mode)
    weights, ids = torch.topk(torch.randn(m, e).softmax(-1), topk)
    r = inputs.RoutedInputs(torch.randn(m, k, dtype=torch.bfloat16), weights, ids.int())
    calls = stage_calls.stage_calls(w1q, w2q, [r], 16, mode, s1, s2)
    assert tuple(calls) == stage_calls.FP8_STAGES and all(len(c) == 1 for c in calls.values())
    out = calls["reduce"][0]()
    block = (128, 128) if mode == "fp8_block" else None
    ref = moe_reference(r.x.float(), dequantize_fp8_reference(w1q, s1, block), dequantize_fp8_reference(w2q, s2, block),
                        r.topk_weights, r.topk_ids)
    assert rel_error(out.float(), ref) < 6e-2


@pytest.mark.usefixtures("on_device")
@pytest.mark.parametrize("mode", ["bf16", "fp8_token"])
def test_grouped_stage_calls_chain_to_the_layer(mode):
    """On the grouped core, the stage calls (align, rows in expert order, up, down, reduce; fp8 the
    quantizations too) run in order give the layer's output bit for bit; the peer's two GEMMs
    alone (bf16: torch._grouped_mm; torch._scaled_grouped_mm has no CPU kernel) on the same
    tokens compose to the float32 reference."""
    e, n, k, m, topk = 4, 128, 256, 33, 2
    w1 = (torch.randn(e, 2 * n, k) / k**0.5).bfloat16()
    w2 = (torch.randn(e, k, n) / n**0.5).bfloat16()
    weights, ids = torch.topk(torch.randn(m, e).softmax(-1), topk)
    r = inputs.RoutedInputs(torch.randn(m, k, dtype=torch.bfloat16), weights, ids.int())
    fp8, peer = mode != "bf16", mode == "bf16"
    (w1q, s1), (w2q, s2) = (peers.quantize_fp8(w1, mode), peers.quantize_fp8(w2, mode)) if fp8 else ((w1, None),
                                                                                                     (w2, None))
    with tmoe.override_route("grouped"):
        assert stage_calls.takes_grouped_route(w1q, w2q, m, topk, mode)
        calls = stage_calls.grouped_stage_calls(w1q, w2q, [r], mode, s1, s2)
        layer = (peers.fp8_provider(w1, w2, mode).fn(r) if fp8 else
                 tmoe.fused_experts(r.x, w1, w2, r.topk_weights, r.topk_ids))
    stages = [s for s in stage_calls.STAGE_ORDER if fp8 or "quant" not in s]
    assert tuple(calls) == tuple(stages)
    for stage in stages[:-1]:
        calls[stage][0]()
    torch.testing.assert_close(calls["reduce"][0](), layer, rtol=0, atol=0)
    if peer:
        gemms = stage_calls.peer_gemm_calls(w1, w2, [r], mode)
        assert tuple(gemms) == ("grouped_mm.up", "grouped_mm.down")
        _, token, _ = peers.sort_by_expert(r.topk_ids, e)
        order = torch.argsort(r.topk_ids.reshape(-1), stable=True)
        gemms["grouped_mm.up"][0]()
        y = gemms["grouped_mm.down"][0]().float() * r.topk_weights.reshape(-1)[order, None]
        out = torch.zeros(m, k).index_add_(0, token, y)
        ref = moe_reference(r.x.float(), w1.float(), w2.float(), r.topk_weights, r.topk_ids)
        assert rel_error(out, ref) < 2e-2


def test_readme_tables_from_one_runs_rows(tmp_path):
    """``python -m tmoe tables``: the rows of one commit and dtype pivoted to shapes x M, peers and
    stages beside tmoe, then the cells below the goals with their stages; other commits' rows and
    absent cells stay out."""
    from tmoe.tools import tables

    env, other = results.Env("d", "gpu", "t", "tr", "abc1234"), results.Env("d", "gpu", "t", "tr", "old0000")
    mk = lambda m, prov, graph, eager, floor=5.0: results.Row(SMALL, "bf16", m, prov, graph, eager, floor, 1e6, 1e9, 2.0)  # noqa: E731
    csv_path = tmp_path / "bench_moe.csv"
    results.append_csv(csv_path, [mk(1, "tmoe", 10.0, 12.0), mk(1, "grouped_mm", "syncs", 20.0),
                                  mk(1, "grouped_mm.up", 8.0, 9.0, 2.0), mk(1, "tmoe.up", 4.0, 5.0, 2.0),
                                  mk(8, "tmoe", 250.0, 260.0, 200.0),
                                  results.Row(inputs.Shape("other", 4, 8, 16, 2), "bf16", 1, "tmoe.rows", 3.0, 3.0, 1.0,
                                              1e6, 0.0, 2.0)], env)
    results.append_csv(csv_path, [mk(1, "tmoe", 99.0, 99.0)], other)
    text = tables.tables(tables.load_rows(csv_path, "abc1234", "bf16"), "bf16")
    assert "| | M=1 | M=8 |" in text
    assert "| small | 0.50 / 0.25 | 0.80 / n/a |" in text  # floor 5 over 10 µs; the peer's eager 20 µs
    assert "| small | 10.0 / 12.0 / 20.0 | 250 / 260 / n/a |" in text
    assert "| small up | 4.0 (0.50) | — |" in text
    assert "| small grouped_mm.up | 8.0 (0.25) | — |" in text  # the peer's GEMM after tmoe's stages
    assert text.index("| small up |") < text.index("| small grouped_mm.up |")
    assert "| other rows | 3.0 | — |" in text and "| small rows |" not in text  # a shape lists only its stages
    assert "- small M=1: 0.50 < 0.85, 10.0 µs; up 4.0 (0.50)\n" in text  # below the goals, with the stages
    assert "- small M=8: 0.80 < 0.95, 250 µs\n" in text
    assert tables.goal("bf16", 1024) == 0.80 and tables.goal("fp8_block", 4096) == 0.65
    assert tables.goal("int4", 1) is None
    both = tables.load_rows(csv_path, "abc1234,old0000", "bf16")  # a comma list: both commits' rows, later ones win
    assert both[("small", 1, "tmoe")]["graph_us"] == "99.0" and ("small", 8, "tmoe") in both
    assert tables.main([str(csv_path), "--commit", "nope"]) == 1
    with pytest.raises(SystemExit):  # argparse's usage error, not a traceback
        tables.main([str(tmp_path / "missing.csv"), "--commit", "abc1234"])


def test_training_tables_from_one_runs_rows(tmp_path, capsys):
    """``python -m tmoe tables bench_train.csv``: fwd+bwd ms and peak MiB of tmoe and the peers
    that ran, tmoe's fraction and speedup; a failed peer cell reads n/a, other commits stay out."""
    import csv as csv_module

    from tmoe.tools import bench_train, tables

    def row(commit, m, provider, ms, peak, fraction="0.50", speedup="1.25", graph="n/a"):
        return dict(date="d", gpu="g", torch="t", triton="tr", commit=commit, shape="qwen3", E=128, N=768, K=2048,
                    topk=8, dtype="bf16", M=m, provider=provider, fwd_bwd_ms=ms, graph_ms=graph, peak_mib=peak,
                    floor_ms="1.0", fraction=fraction, speedup_vs_grouped_mm=speedup, max_rel_err="n/a", note="")

    path = tmp_path / "bench_train.csv"
    with path.open("w", newline="") as f:
        out = csv_module.DictWriter(f, fieldnames=bench_train.CSV_FIELDS)
        out.writeheader()
        out.writerows([row("abc1234", 1024, "tmoe", "2.0", "100", graph="1.5"),
                       row("abc1234", 1024, "grouped_mm", "2.5", "120", graph="2.4"),
                       row("abc1234", 1024, "liger[pinned]", "n/a (OutOfMemoryError)", "n/a"),
                       row("abc1234", 4096, "tmoe", "8.0", "300", speedup="n/a"),
                       row("old0000", 1024, "tmoe", "99.0", "999")])
    assert tables.main([str(path), "--commit", "abc1234"]) == 0
    text = capsys.readouterr().out
    assert "forward+backward ms, tmoe / grouped_mm / liger[pinned]:" in text
    assert "| qwen3 | 2.0 / 2.5 / n/a | 8.0 / n/a / n/a |" in text
    assert "the step captured in a CUDA graph, replay ms, tmoe / grouped_mm:" in text  # liger: none captured
    assert "| qwen3 | 1.5 / 2.4 | n/a / n/a |" in text
    assert "| qwen3 | 100 / 120 / n/a | 300 / n/a / n/a |" in text
    assert "| qwen3 | 0.50 (1.25x) | 0.50 (n/a) |" in text
    assert "99.0" not in text
