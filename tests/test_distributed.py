"""Expert parallelism over torch.distributed: 2 ranks with gloo on CPU (NCCL on a GPU machine)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _rank_main(rank: int, init_file: str, chunk_size: int, routing: str) -> None:
    import tmoe
    from tmoe.modular import AllGatherPrepareAndFinalize
    from tmoe.reference import moe_reference
    from tmoe.testing import assert_close
    from tmoe.testing.strategies import MoEShape, make_problem

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        e_global, m_local = 8, 6
        # every rank draws the same global problem, then takes its tokens and its experts
        p = make_problem(MoEShape(WORLD * m_local, e_global, 64, 72, 2), torch.float32, routing, seed=5, device=device)
        experts = torch.arange(e_global, device=device)
        mine = experts % WORLD == rank
        expert_map = torch.where(mine, torch.cumsum(mine.int(), 0) - 1, -1).to(torch.int32)
        kernel = tmoe.FusedMoEModularKernel(AllGatherPrepareAndFinalize(), tmoe.TritonExperts(), chunk_size=chunk_size)
        rows = slice(rank * m_local, (rank + 1) * m_local)
        out = kernel(p.x[rows], p.w1[mine].contiguous(), p.w2[mine].contiguous(), p.topk_weights[rows].contiguous(),
                     p.topk_ids[rows].contiguous(), global_num_experts=e_global, expert_map=expert_map)
        ref = moe_reference(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)[rows]
        assert_close(out, ref, torch.float32, name=f"rank {rank} output")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chunk_size, routing", [(32768, "uniform"), (4, "out_of_range")])
def test_all_gather_expert_parallel_two_ranks(chunk_size, routing):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(os.path.join(tmp, "init"), chunk_size, routing), nprocs=WORLD, join=True)
