"""Test setup: run the real Triton kernels under the interpreter when no GPU is present,
poison torch.empty outputs with NaN, seed everything, bound hypothesis."""
import gc
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch._inductor.config

    # CPU CI (2 cores, one pytest-xdist worker each): Inductor compiles in-process, as a pool of
    # compile workers per test worker costs more to start than it saves on tmoe's small graphs
    torch._inductor.config.compile_threads = 1

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from tmoe.testing import poison  # noqa: E402

settings.register_profile(
    "ci", max_examples=int(os.environ.get("TMOE_HYPOTHESIS_EXAMPLES", "12")), deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: one torch thread per worker, the workers fill the cores
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


CACHE_KEPT_BYTES = 1 << 30  # a GPU test's cached memory past this goes back to the device after it


@pytest.fixture(autouse=True)
def _one_large_memory_test_at_a_time(request, tmp_path_factory):
    """Tests marked ``large_memory`` hold a lock shared by the pytest-xdist workers (their common
    base temp directory), so ``pytest -n auto`` on one GPU does not run several at once (four at a
    time ran an 80 GB H100 out of memory). After any test, a worker that caches more than
    ``CACHE_KEPT_BYTES`` frees it, so memory one test cached is not held while others run."""
    if not torch.cuda.is_available():
        yield
        return
    if request.node.get_closest_marker("large_memory") is None:
        yield
        _free_cache(CACHE_KEPT_BYTES)
        return
    import fcntl

    with open(tmp_path_factory.getbasetemp().parent / "tmoe-large-memory.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            _free_cache(0)
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_cache(keep: int) -> None:
    if torch.cuda.memory_reserved() > keep:
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _seed_and_poison(monkeypatch):
    """Seed torch; make torch.empty/empty_like return poisoned memory (NaN, or the largest int)."""
    torch.manual_seed(0)
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        with torch.no_grad():
            return poison(t)

    def empty(*args, **kwargs):
        return fill(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return fill(real_empty_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    yield


@pytest.fixture
def device():
    return DEVICE


def _forced_route(name: str):
    from tmoe.config import override_route

    with override_route(name):
        yield name


@pytest.fixture
def shipped_swap_tiles():
    """``(pattern) -> [MoEConfig]``: the distinct up and down swap_ab tile shapes of the shipped
    tables whose file names match ``pattern``, paired in order (warps and stages, which the
    interpreter ignores, set to one value)."""
    from dataclasses import replace
    from pathlib import Path

    from tmoe.config import MoEConfig, read_table
    from tmoe.config.tables import SHIPPED_CONFIGS

    def tiles(pattern: str) -> list[MoEConfig]:
        rows = [row for path in Path(SHIPPED_CONFIGS).glob(pattern) for row in read_table(path).values()]
        ups, downs = ({replace(c, num_warps=4, num_stages=2) for c in cfgs if c.swap_ab}
                      for cfgs in ([r.up for r in rows], [r.down for r in rows]))
        ups, downs = sorted(ups, key=str), sorted(downs, key=str)
        return [MoEConfig(ups[i % len(ups)], downs[i % len(downs)]) for i in range(max(len(ups), len(downs)))]

    return tiles


@pytest.fixture(params=["sorted", "direct", "slots", "fused", "grouped"])
def route(request):
    """Run the test under each Standard-format path: aligned, decode (no align, the down GEMM
    sums each token's slots), slots (no align, both GEMMs per slot), fused (both GEMMs per slot
    and intermediate block in one kernel, then a reduce; fp8 layers take "sorted" there) and grouped
    (expert-sorted rows, both operands by TMA; operands it cannot read take "sorted"); M alone
    would pick one."""
    yield from _forced_route(request.param)


@pytest.fixture(params=["sorted", "direct", "slots"])
def fp8_route(request):
    """``route`` for fp8 activations, which never take the fused path (tests/layer/test_fused_experts.py
    asserts it): forced "fused", they run the aligned path again, so it is left out."""
    yield from _forced_route(request.param)


@pytest.fixture(params=["sorted", "direct"])
def fp8_matrix_route(request):
    """``matrix_route`` for fp8 activations (no fused path, see ``fp8_route``), and for matrices whose
    fused-path cases a test of their own covers."""
    yield from _forced_route(request.param)


@pytest.fixture(params=["sorted", "direct", "fused"])
def matrix_route(request):
    """The aligned path and the two decode paths that reduce in the experts (the down GEMM summing
    each token's slots, and the fused one), for the large case matrices (tiles x dtypes x schemes);
    the slots path, whose two GEMMs are the direct path's up GEMM kind, runs every ``route`` test and
    the small-M cases of test_fused_experts (CI time)."""
    yield from _forced_route(request.param)
