"""Which engine the grouped GEMMs take: the Gluon engine only where asked for (``TMOE_GLUON=1`` or
``override_engine("gluon")``) and able to run (an sm_90 GPU, not the interpreter); the ``tl``
kernels otherwise, and inside ``override_engine("tl")`` whatever the environment says."""
import pytest
import torch

from tmoe.runtime import gluon


def test_engine_off_a_gpu_and_by_default(monkeypatch):
    monkeypatch.delenv("TMOE_GLUON", raising=False)
    cpu = torch.device("cpu")
    assert not gluon.gluon_ready(cpu)
    with gluon.override_engine("gluon"):
        assert not gluon.gluon_ready(cpu)  # asked for, but no GPU to run on
    monkeypatch.setattr(gluon, "_hopper", lambda index: True)
    monkeypatch.setattr(gluon, "INTERPRETED", False)
    cuda = torch.device("cuda", 0)
    assert not gluon.gluon_ready(cuda)  # not asked for
    monkeypatch.setenv("TMOE_GLUON", "1")
    assert gluon.gluon_ready(cuda)
    with gluon.override_engine("tl"):
        assert not gluon.gluon_ready(cuda)
    monkeypatch.setenv("TMOE_GLUON", "0")
    with gluon.override_engine("gluon"):
        assert gluon.gluon_ready(cuda)


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="engine must be one of"):
        with gluon.override_engine("cutlass"):
            pass
