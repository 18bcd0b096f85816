"""Topology: the groups of a config's grid, addressed by name, each one a working process group."""

import pytest
import torch

from megatronish.config.schema import ParallelConfig
from megatronish.distributed.comm import all_reduce
from megatronish.distributed.parallel_grid import GROUP_NAMES, ParallelGrid
from megatronish.distributed.topology import Topology
from megatronish.testing.multiproc import run_world


def test_one_process_from_config():
    topo = Topology.from_config(ParallelConfig(collective_timeout_s=5.0), rank=0, world_size=1)
    assert (topo.tp, topo.cp, topo.dp, topo.pp, topo.ep, topo.edp) == (1, 1, 1, 1, 1, 1)
    assert set(topo.groups) == set(GROUP_NAMES)
    for name in GROUP_NAMES:
        group = topo.group(name)
        assert group.ranks == (0,) and group.pg is None and group.timeout_s == 5.0
    assert topo.dp_cp_group is topo.group("dp_cp") is topo.group("dp")  # no second communicator
    assert topo.edp_group is topo.group("dp_cp")
    with pytest.raises(
        KeyError, match="no group 'dp-cp' in this Topology: it has tp, cp, cp_a2a, cp_ring, dp"
    ):
        topo.group("dp-cp")
    with pytest.raises(ValueError, match="rank 1 is outside a world of 1"):
        Topology.from_config(ParallelConfig(), rank=1, world_size=1)


CONFIGS = [
    ParallelConfig(tp=2),  # dp: what the world leaves (2)
    ParallelConfig(cp=2, pp=2),
    ParallelConfig(dp=4, ep=2),
    ParallelConfig(tp=2, cp=2, ep=2),
    ParallelConfig(cp=4, cp_comm_type="a2a_ring", cp_a2a_size=2),
    ParallelConfig(cp=2, zero_stage=2, zero_shard_size=1),
]


def _groups(rank, world):
    out = []
    for parallel in CONFIGS:
        topo = Topology.from_config(parallel, rank, world)
        mine = {}
        for name in GROUP_NAMES:
            group = topo.group(name)
            summed = group.ranks[0] if group.pg is None else all_reduce(torch.tensor(rank), group)
            mine[name] = (group.ranks, group.rank, int(summed))
        out.append((topo.coords, topo.grid.expert.coords(rank), mine))
    return out


def test_every_rank_holds_the_groups_of_its_grid():
    """Each named group is the grid's group of this rank, and its process group joins exactly
    those ranks (an all-reduce of the rank numbers sums them)."""
    for rank, per_config in enumerate(run_world(_groups, 4, timeout=120)):
        for parallel, (coords, expert, mine) in zip(CONFIGS, per_config):
            grid = ParallelGrid.from_config(parallel, 4)
            assert coords == grid.coords(rank) and expert == grid.expert.coords(rank)
            for name, (ranks, index, summed) in mine.items():
                want = next((g for g in grid.groups(name) if rank in g), [rank])
                assert ranks == tuple(want), (parallel, name)
                assert ranks[index] == rank
                assert summed == sum(ranks), (parallel, name)
