"""Tile-config lookup: override > tuned table (nearest M, up to twice its largest M) > heuristic;
shared-memory fitting."""
import json

import pytest
import torch

import tmoe
from tmoe.config import config_file_name, get_config, save_table
from tmoe.kernels.gemm_args import fit_shared_memory
from tmoe.runtime.device import SHARED_MEMORY_BUDGET


def test_heuristic_block_m_grows_with_tokens_per_expert():
    dev = torch.device("cpu")
    sizes = [get_config(m, 8, 64, 64, 2, dev).block_m for m in (1, 64, 256, 4096)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] == 128


def test_table_lookup_nearest_m_and_env_dir(tmp_path, monkeypatch):
    small = tmoe.MoEConfig(tmoe.GemmConfig(16, 32, 128), tmoe.GemmConfig(16, 64, 256))
    large = tmoe.MoEConfig(tmoe.GemmConfig(64, 64, 64), tmoe.GemmConfig(64, 128, 64))
    save_table(tmp_path / config_file_name(3, 40, "cpu", None), {8: small, 1024: large})
    assert json.loads((tmp_path / config_file_name(3, 40, "cpu", None)).read_text())["8"]["up"]["block_n"] == 32
    monkeypatch.setenv("TMOE_CONFIG_DIR", str(tmp_path))
    dev = torch.device("cpu")
    assert get_config(1, 3, 40, 64, 2, dev) == small
    assert get_config(900, 3, 40, 64, 2, dev) == large
    assert get_config(900, 3, 41, 64, 2, dev) != large  # no table for N=41: heuristic
    assert get_config(2048, 3, 40, 64, 2, dev) == large  # up to twice the largest tuned M
    heuristic = get_config(2049, 3, 41, 64, 2, dev)
    assert get_config(2049, 3, 40, 64, 2, dev) == heuristic != large  # beyond: the heuristic, not the last row
    with tmoe.override_config(small):
        assert get_config(900, 3, 40, 64, 2, dev) == small


def test_shipped_tables_load():
    from tmoe.config.tables import SHIPPED_CONFIGS, load_table

    tables = list(SHIPPED_CONFIGS.glob("*.json"))
    assert tables, "tuned tables must ship in the package"
    for path in tables:
        assert load_table(path.name, (path.parent,))


@pytest.mark.parametrize("elem_size, gated", [(4, True), (2, True), (1, False)])
def test_fit_shared_memory(elem_size, gated):
    cfg = tmoe.GemmConfig(128, 128, 128, num_stages=5)
    fitted = fit_shared_memory(cfg, elem_size, gated)
    tile_n = 256 if gated else 128
    assert fitted.num_stages * fitted.block_k * (128 + tile_n) * elem_size <= SHARED_MEMORY_BUDGET
    assert fitted.block_m == 128 and fitted.block_n == 128


def test_bad_gemm_config():
    with pytest.raises(ValueError, match="block_n"):
        tmoe.GemmConfig(16, 48, 64)
    with pytest.raises(ValueError, match="swap_ab"):
        tmoe.GemmConfig(16, 32, 64, swap_ab=True)
    with pytest.raises(ValueError, match="block_m"):
        tmoe.MoEConfig(tmoe.GemmConfig(16, 64, 64), tmoe.GemmConfig(32, 64, 64))


def test_table_round_trip_keeps_direct_down(tmp_path):
    from tmoe.config import read_table

    GemmConfig, MoEConfig = tmoe.GemmConfig, tmoe.MoEConfig
    up, down = GemmConfig(16, 32, 128), GemmConfig(16, 64, 256, num_stages=3, swap_ab=True)
    table = {1: MoEConfig(up, down, GemmConfig(16, 16, 128, num_stages=6)), 64: MoEConfig(up, down)}
    save_table(tmp_path / "t.json", table)
    assert read_table(tmp_path / "t.json") == table


@pytest.mark.parametrize("m", [1, 64, 4096])
def test_low_bit_heuristic_keeps_block_k_without_tma(m):
    """Weight-only low-bit layers without a table: the bf16 heuristic's block_k (K steps over
    several mxfp4 groups of 32, as the tuned tables pick), pointer loads (the group size reaches
    the heuristic)."""
    cfg = get_config(m, 128, 768, 2048, 8, torch.device("cpu"), quant="mxfp4_w4a16", group_size=32)
    bf16 = get_config(m, 128, 768, 2048, 8, torch.device("cpu"))
    for g, plain in ((cfg.up, bf16.up), (cfg.down, bf16.down)):
        assert g.block_k == plain.block_k > 32 and not g.tma
    if m == 4096:  # large bf16 tiles load the weights by TMA; low-bit codes cannot be
        assert bf16.down.tma


@pytest.mark.parametrize("m", [1, 64, 4096])
def test_low_bit_heuristic_block_k_divides_k(m):
    """GPT-OSS (K = N = 2880, no table): the low-bit heuristic's block_k divides each GEMM's K (64),
    so no K step masks its code loads; a K that no block_k >= 32 divides keeps the heuristic's."""
    plain = get_config(m, 32, 2880, 2880, 4, torch.device("cpu"))
    cfg = get_config(m, 32, 2880, 2880, 4, torch.device("cpu"), quant="mxfp4_w4a16", group_size=32)
    for g in (cfg.up, cfg.down):
        assert 2880 % g.block_k == 0 and g.block_k == min(64, plain.up.block_k)
    odd = get_config(m, 32, 2880, 2888, 4, torch.device("cpu"), quant="int4_w4a16", group_size=32)
    assert (odd.up.block_k, odd.down.block_k) == (plain.up.block_k, cfg.down.block_k)


def test_low_bit_decode_tiles_fill_the_gpu():
    """Low-bit decode tiles without a table: block_n halves (to 32) until the row blocks fill 132 SMs
    twice. GPT-OSS M=1 (4 slots): 32 for both GEMMs; M=8 (32 experts touched at most): as before."""
    from tmoe.config import _heuristic

    one = _heuristic(1, 32, 2880, 2880, 4, None, 32, sms=132)
    assert (one.up.block_n, one.down.block_n) == (32, 32)
    eight = _heuristic(8, 32, 2880, 2880, 4, None, 32, sms=132)
    assert (eight.up.block_n, eight.down.block_n) == (64, 128)
    assert _heuristic(1, 32, 2880, 2880, 4, None, None, sms=132).up.block_n == 64  # bf16 keeps its tiles


def test_low_bit_tables_are_named_and_found(tmp_path, monkeypatch):
    """Tables written under the tune CLI's low-bit names (vLLM's dtype=..._w4a16 style) are the
    ones a layer with that FusedMoEQuantConfig looks up."""
    from tmoe.tools.tune import TABLE_DTYPES

    tuned = tmoe.MoEConfig(tmoe.GemmConfig(16, 32, 32), tmoe.GemmConfig(16, 64, 32))
    dev = torch.device("cpu")
    for scheme, group in (("int4", 128), ("int8", 64), ("mxfp4", 32)):
        qc = tmoe.FusedMoEQuantConfig(weight_dtype=scheme, group_size=group)
        assert qc.quant_name == TABLE_DTYPES[scheme]
        save_table(tmp_path / config_file_name(5, 40, "cpu", TABLE_DTYPES[scheme]), {8: tuned})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"E=5,N=40,device_name=cpu,dtype={d}.json" for d in ("int4_w4a16", "int8_w8a16", "mxfp4_w4a16")]
    monkeypatch.setenv("TMOE_CONFIG_DIR", str(tmp_path))
    for scheme, group in (("int4", 128), ("int8", 64), ("mxfp4", 32)):
        quant = TABLE_DTYPES[scheme]
        assert get_config(8, 5, 40, 64, 2, dev, quant=quant, group_size=group) == tuned
    assert get_config(8, 5, 40, 64, 2, dev, group_size=32) != tuned  # bf16's name: no table, heuristic


def test_tune_candidates_include_two_programs_per_sm():
    """At block_m 128 the bf16 candidates include, for each GEMM, a tile whose pipelined operands
    (num_stages x (A tile + weight tile), bf16) fit twice in the H200's 228 KB of shared memory."""
    from tmoe.tools.tune import candidates

    for gated in (True, False):
        smem = [c.num_stages * (c.block_m + c.block_n * (1 + gated)) * c.block_k * 2
                for c in candidates(128, gated) if not c.tma]
        assert min(smem) <= 113 * 1024 < max(smem)


def test_tune_fp8_decode_candidates_include_swap_ab():
    """fp8 below block_m 64: the tuner times swap_ab tiles (wgmma on fp8) beside the plain ones
    (mma.sync on weights converted to fp16); not at block_m 64, and not in bf16."""
    from tmoe.tools.tune import candidates

    for quant in ("fp8_block", "fp8_token"):
        small = candidates(16, True, quant)
        assert any(c.swap_ab for c in small) and any(not c.swap_ab for c in small)
        assert all(c.block_n >= 64 and not c.tma for c in small if c.swap_ab)
        assert not any(c.swap_ab for c in candidates(64, True, quant))
    assert not any(c.swap_ab for c in candidates(16, True))


def test_tune_variant_candidates():
    """The tuner's --tma / --swap / --persistent candidates: each of its kind and valid, none of the
    TMA kinds for low-bit codes, and the CLI refuses those and mixed flags before touching a GPU."""
    from tmoe.tools.tune import main, variant_candidates

    for block_m, gated in ((16, True), (64, False)):
        swap = variant_candidates(block_m, gated, "none", "swap")
        assert swap and all(c.swap_ab and not c.tma and c.block_n >= 64 and c.block_m == block_m for c in swap)
        persistent = variant_candidates(block_m, gated, "fp8_block", "persistent")
        assert persistent and all(c.persistent and c.tma and c.block_k <= 128 for c in persistent)
        assert all(c.tma and not c.persistent for c in variant_candidates(block_m, gated, "none", "tma"))
    assert all(c.swap_ab and not c.tma for c in variant_candidates(64, True, "int4", "swap"))
    with pytest.raises(ValueError, match="load by pointers"):
        variant_candidates(64, True, "mxfp4", "persistent")
    for argv in (["--quant", "int4", "--persistent"], ["--quant", "mxfp4", "--tma"], ["--tma", "--swap"],
                 ["--direct", "--persistent"]):
        with pytest.raises(SystemExit):
            main(["--shape", "qwen3", *argv])
