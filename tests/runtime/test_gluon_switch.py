"""Which engine the grouped GEMMs take: the Gluon engine only where it can run (an sm_90 GPU, not the
interpreter): the float up GEMM of enough rows per expert by default, every grouped GEMM with ``TMOE_GLUON=1`` or inside
``override_engine("gluon")``, neither with ``TMOE_GLUON=0`` or inside ``override_engine("tl")``."""
import pytest
import torch

from tmoe.runtime import gluon

MANY = 4 * gluon.DEFAULT_MIN_ROWS_PER_EXPERT  # routed rows per expert of a large call


def test_engine_by_gemm_environment_and_override(monkeypatch):
    monkeypatch.delenv("TMOE_GLUON", raising=False)
    cpu = torch.device("cpu")
    with gluon.override_engine("gluon"):
        assert not gluon.gluon_ready(cpu, "up", MANY)  # asked for, but no GPU to run on
    monkeypatch.setattr(gluon, "_hopper", lambda index: True)
    monkeypatch.setattr(gluon, "INTERPRETED", False)
    cuda = torch.device("cuda", 0)
    assert gluon.gluon_ready(cuda, "up", MANY) and not gluon.gluon_ready(cuda, "down", MANY)  # the default
    rows = gluon.DEFAULT_MIN_ROWS_PER_EXPERT
    assert gluon.gluon_ready(cuda, "up", rows) and not gluon.gluon_ready(cuda, "up", rows / 2)  # DeepSeek-V3 M = 4096
    assert not gluon.gluon_ready(cuda, "up.fp8", MANY)
    assert not gluon.gluon_ready(cuda, "dx", MANY)
    monkeypatch.setenv("TMOE_GLUON", "1")
    assert all(gluon.gluon_ready(cuda, g, 1) for g in ("up", "down", "up.fp8", "down.fp8"))  # asked: at any rows
    with gluon.override_engine("tl"):
        assert not gluon.gluon_ready(cuda, "up", MANY)
    monkeypatch.setenv("TMOE_GLUON", "0")
    assert not gluon.gluon_ready(cuda, "up", MANY)
    with gluon.override_engine("gluon"):
        assert gluon.gluon_ready(cuda, "down", MANY)
    monkeypatch.setattr(gluon, "_hopper", lambda index: False)  # another architecture
    with gluon.override_engine("gluon"):
        assert not gluon.gluon_ready(cuda, "up", MANY)


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="engine must be one of"):
        with gluon.override_engine("cutlass"):
            pass
