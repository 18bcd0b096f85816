"""The fork-based gloo harness itself: results come back in order, failures surface."""

import pytest
import torch
import torch.distributed as dist

from megatronish.testing.multiproc import RankAssertionError, WorldError, run_world


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


def _check_on_rank1(rank, world):
    assert rank != 1, "rank 1 disagrees"
    dist.barrier()


def test_a_ranks_failed_check_is_re_raised_as_an_assertion_and_a_crash_is_not():
    """A rank's ``AssertionError`` reaches pytest (and tools/mutants.py) as one; another
    exception stays a :class:`WorldError` naming what the rank raised."""
    with pytest.raises(RankAssertionError, match="rank 1 disagrees") as e:
        run_world(_check_on_rank1, 2, timeout=30, collective_timeout=5)
    assert isinstance(e.value, AssertionError) and e.value.root_type == "AssertionError"
    with pytest.raises(WorldError, match="boom on rank 1") as e:
        run_world(_raise_on_rank1, 2, timeout=30, collective_timeout=5)
    assert not isinstance(e.value, AssertionError) and e.value.root_type == "ValueError"
