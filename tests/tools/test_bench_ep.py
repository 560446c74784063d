"""The expert-parallel benchmark (``python -m tmoe bench-ep``): its payload arithmetic, and a run at world size 1."""


def test_bench_ep_payload_by_hand():
    from tmoe.tools.bench_ep import Result, capacity_for, markdown, payload

    assert capacity_for(64, 128, 8, 2.0) == 8 and capacity_for(1, 256, 8, 2.0) == 1 and capacity_for(4, 2, 2, 2.0) == 4
    # all-gather over 4 ranks: 4 ranks' 10 tokens of 16 bf16 + 2 ids and weights; fp32 partial sums back
    assert payload("allgather", 10, 8, 16, 2, 4, 0, 2, 0) == (4 * 10 * (32 + 16), 4 * 10 * 16 * 4)
    # all-to-all, E=8, C=3: the (8, 3, 16) fp8 buffer + its 2 scale columns + 8 counts; bf16 outputs back
    assert payload("alltoall", 10, 8, 16, 2, 4, 3, 1, 2) == (8 * 3 * (16 + 8) + 32, 8 * 3 * 32)
    row = Result("s", 10, "alltoall", 4, 9.0, 2.0, 4.0, 2e6, 4e6, 1)
    cells = markdown([row], link_gbps=1000.0).splitlines()[2].split(" | ")
    assert cells[6:10] == ["2.000", "4.000", "750.0 (75%)", "750.0 (75%)"]  # 3/4 of 2 MB in 2 µs


def test_bench_ep_runs_at_world_size_1(capfd):
    """One header, then each (shape, M, impl) row exactly once."""
    from tmoe.tools.bench_ep import main

    assert main(["--shapes", "tiny", "--ms", "3", "5", "--iters", "1", "--warmup", "0", "--world-size", "1"]) == 0
    lines = capfd.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| tiny |")]
    assert [r.split(" | ")[1:3] for r in rows] == [["3", "allgather"], ["3", "alltoall"], ["5", "allgather"],
                                                   ["5", "alltoall"]]
    assert sum(line.startswith("| shape |") for line in lines) == 1
