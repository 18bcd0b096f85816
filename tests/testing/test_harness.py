"""The fork-based gloo harness itself: results come back in order, failures surface."""

import pytest
import torch
import torch.distributed as dist

from megatronish.testing.multiproc import WorldError, run_world


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, t.item()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_all_reduce_world_returns_results_in_rank_order(world):
    out = run_world(_sum_ranks, world)
    assert [r for r, _ in out] == list(range(world))
    assert all(s == sum(range(world)) for _, s in out)


def _raise_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


def test_exception_on_one_rank_is_reported_without_hanging():
    with pytest.raises(WorldError, match="boom on rank 1"):
        run_world(_raise_on_rank1, 2, timeout=30, collective_timeout=5)
