"""The Topology: this rank's place in the tp x cp x dp x pp grid and its process groups.

A Topology is built once at start-up and passed explicitly to everything that communicates.
There is no module-level process-group state.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatronish.distributed.comm import CommStats, ParallelGroup
from megatronish.distributed.parallel_grid import GROUP_NAMES, Coords, ParallelGrid

if TYPE_CHECKING:
    from megatronish.config.schema import ParallelConfig


@dataclass
class Topology:
    """This rank, the grid, its groups (by name: :data:`GROUP_NAMES`), its device and the comm
    counter."""

    rank: int
    grid: ParallelGrid
    groups: dict[str, ParallelGroup]
    device: torch.device
    stats: CommStats

    def group(self, name: str) -> ParallelGroup:
        """This rank's group ``name`` (tp, cp, dp, dp_cp, ep, edp, pp, mp, embedding, world)."""
        if name not in self.groups:
            raise KeyError(f"no group {name!r} in this Topology: it has {', '.join(self.groups)}")
        return self.groups[name]

    @cached_property
    def coords(self) -> Coords:
        return self.grid.coords(self.rank)

    @property
    def tp(self) -> int:
        return self.grid.size("tp")

    @property
    def cp(self) -> int:
        return self.grid.size("cp")

    @property
    def dp(self) -> int:
        return self.grid.size("dp")

    @property
    def pp(self) -> int:
        return self.grid.size("pp")

    @property
    def ep(self) -> int:
        return self.grid.size("ep")

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same parameters: gradients are averaged, ZeRO shards spread, over
        them."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (expert data parallel): ``dp * cp / ep``."""
        return self.grid.size("edp")

    @property
    def ep_group(self) -> ParallelGroup:
        """The ranks that exchange tokens and hold different experts."""
        return self.group("ep")

    @property
    def edp_group(self) -> ParallelGroup:
        """The ranks holding the same experts: expert grads are reduced, their ZeRO shards
        spread, over them."""
        return self.group("edp")

    @property
    def cp_group(self) -> ParallelGroup:
        return self.group("cp")

    @property
    def dp_cp_group(self) -> ParallelGroup:
        return self.group("dp_cp")

    @property
    def zero_shard_group(self) -> ParallelGroup:
        """The ranks ZeRO shards the dense params' state over: dp x cp, or under hybrid
        sharding cp x ``zero_shard_size`` consecutive dp ranks."""
        return self.group("zero_shard")

    @property
    def zero_replica_group(self) -> ParallelGroup:
        """The ranks holding the same ZeRO shard (hybrid sharding; one rank otherwise)."""
        return self.group("zero_replica")

    @property
    def tp_group(self) -> ParallelGroup:
        return self.group("tp")

    @property
    def dp_group(self) -> ParallelGroup:
        return self.group("dp")

    @property
    def pp_group(self) -> ParallelGroup:
        return self.group("pp")

    @property
    def mp_group(self) -> ParallelGroup:
        return self.group("mp")

    @property
    def embedding_group(self) -> ParallelGroup:
        return self.group("embedding")

    @property
    def world_group(self) -> ParallelGroup:
        return self.group("world")

    def close(self) -> None:
        """Drop this Topology's references to its process groups, so that destroying them
        (:func:`~megatronish.distributed.shutdown.shutdown_process_groups`) ends their threads.
        The groups cannot be used afterwards."""
        for group in self.groups.values():
            group.pg = None

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.pp - 1

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> Topology:
        """The one-process topology (no torch.distributed needed)."""
        return cls.build(tp=1, dp=1, pp=1, rank=0, device=device)

    @classmethod
    def build(
        cls,
        *,
        tp: int,
        dp: int,
        pp: int,
        rank: int,
        device: torch.device | str = "cpu",
        timeout_s: float | None = None,
        cp: int = 1,
        ep: int = 1,
        cp_a2a: int = 1,
        zero_shard: int | None = None,
    ) -> Topology:
        """:meth:`create` on the grid of these degrees (``cp_a2a``: a2a_ring's cp_a2a_size,
        ``zero_shard``: hybrid sharding's zero_shard_size)."""
        grid = ParallelGrid.of(
            tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, cp_a2a=cp_a2a, zero_shard=zero_shard
        )
        return cls.create(grid, rank, device, timeout_s)

    @classmethod
    def from_config(
        cls,
        parallel: ParallelConfig,
        rank: int,
        world_size: int,
        device: torch.device | str = "cpu",
    ) -> Topology:
        """:meth:`create` for a validated config's ``parallel`` section in a world of
        ``world_size`` ranks (``parallel.dp: null`` takes what the world leaves), every op
        bounded by ``parallel.collective_timeout_s``."""
        grid = ParallelGrid.from_config(parallel, world_size)
        return cls.create(grid, rank, device, parallel.collective_timeout_s)

    @classmethod
    def create(
        cls,
        grid: ParallelGrid,
        rank: int,
        device: torch.device | str = "cpu",
        timeout_s: float | None = None,
    ) -> Topology:
        """Create every group of the grid. Collective: all ranks call it with the same grid.

        torch.distributed must already be initialised when the world has more than one rank.
        ``timeout_s`` (``parallel.collective_timeout_s``) bounds every op of the new groups: they
        do not inherit the default group's timeout. None keeps torch's default. Each new group's
        description (``group_desc``) is its name; the world group is torch's default group,
        described as ``default_pg``.
        """
        world = grid.world_size
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world} ({grid.dense})")
        if world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("a Topology needs torch.distributed initialised for world > 1")
        if world > 1 and dist.get_world_size() != world:
            degrees = "*".join(str(grid.size(a)) for a in ("tp", "cp", "dp", "pp"))
            raise ValueError(
                f"tp*cp*dp*pp = {degrees} = {world} but the job has {dist.get_world_size()} ranks"
            )
        stats = CommStats()
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        groups: dict[str, ParallelGroup] = {}
        for name in GROUP_NAMES:
            if grid.communicator(name) != name:  # the same ranks: no second communicator
                groups[name] = groups[grid.communicator(name)]
                continue
            all_groups = grid.groups(name)
            mine = None
            # Every rank creates every group in the same order (torch.distributed requires it).
            for ranks in all_groups:
                if len(ranks) == 1:
                    continue
                if name == "world":
                    pg = dist.group.WORLD
                else:  # NCCL's reports name it: "[PG ID 2 PG GUID 5(tp) Rank 1] ..."
                    pg = dist.new_group(ranks, timeout=timeout, group_desc=name)
                if rank in ranks:
                    mine = pg
            # Middle pipeline stages hold no embedding copy: their embedding group is themselves.
            if mine is None and name == "embedding":
                ranks = [rank]
            else:
                ranks = next(g for g in all_groups if rank in g)
            if len(ranks) == 1:
                mine = None
            groups[name] = ParallelGroup(
                name=name,
                ranks=tuple(ranks),
                rank=ranks.index(rank),
                pg=mine,
                stats=stats,
                timeout_s=timeout_s,
            )
        return cls(rank=rank, grid=grid, groups=groups, device=torch.device(device), stats=stats)
