"""The Topology: this rank's place in the tp x cp x dp x pp grid and its process groups.

A Topology is built once at start-up and passed explicitly to everything that communicates.
There is no module-level process-group state.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronish.distributed.comm import CommStats, ParallelGroup
from megatronish.distributed.rank_math import Coords, group_of, group_ranks, rank_to_coords

GROUP_NAMES = ("tp", "cp", "dp", "dp_cp", "ep", "edp", "pp", "mp", "embedding", "world")


@dataclass
class Topology:
    """Grid shape, this rank's coordinates, its groups, its device and the comm counter."""

    tp: int
    dp: int
    pp: int
    rank: int
    coords: Coords
    groups: dict[str, ParallelGroup]
    device: torch.device
    stats: CommStats
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same parameters: gradients are averaged, ZeRO shards spread, over
        them."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (expert data parallel): ``dp * cp / ep``."""
        return self.dp_cp // self.ep

    @property
    def ep_group(self) -> ParallelGroup:
        """The ranks that exchange tokens and hold different experts."""
        return self.groups["ep"]

    @property
    def edp_group(self) -> ParallelGroup:
        """The ranks holding the same experts: expert grads are reduced, their ZeRO shards
        spread, over them."""
        return self.groups["edp"]

    @property
    def cp_group(self) -> ParallelGroup:
        return self.groups["cp"]

    @property
    def dp_cp_group(self) -> ParallelGroup:
        return self.groups["dp_cp"]

    @property
    def tp_group(self) -> ParallelGroup:
        return self.groups["tp"]

    @property
    def dp_group(self) -> ParallelGroup:
        return self.groups["dp"]

    @property
    def pp_group(self) -> ParallelGroup:
        return self.groups["pp"]

    @property
    def mp_group(self) -> ParallelGroup:
        return self.groups["mp"]

    @property
    def embedding_group(self) -> ParallelGroup:
        return self.groups["embedding"]

    @property
    def world_group(self) -> ParallelGroup:
        return self.groups["world"]

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
        tp: int,
        dp: int,
        pp: int,
        rank: int,
        device: torch.device | str = "cpu",
        timeout_s: float | None = None,
        cp: int = 1,
        ep: int = 1,
    ) -> Topology:
        """Create every group of the grid. Collective: all ranks call it with the same shape.

        torch.distributed must already be initialised when the world has more than one rank.
        ``timeout_s`` (``parallel.collective_timeout_s``) bounds every op of the new groups: they
        do not inherit the default group's timeout. None keeps torch's default. Each new group's
        description (``group_desc``) is its name; the world group is torch's default group,
        described as ``default_pg``.
        """
        world = tp * cp * dp * pp
        if world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Topology.build needs torch.distributed initialised for world > 1")
        if world > 1 and dist.get_world_size() != world:
            raise ValueError(
                f"tp*cp*dp*pp = {tp}*{cp}*{dp}*{pp} = {world} but the job has "
                f"{dist.get_world_size()} ranks"
            )
        stats = CommStats()
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        groups: dict[str, ParallelGroup] = {}
        for name, all_groups in group_ranks(tp, dp, pp, cp, ep).items():
            if name == "dp_cp" and cp == 1:  # the dp group itself: no second communicator
                groups[name] = groups["dp"]
                continue
            if name == "edp" and ep == 1:  # the dp_cp group itself
                groups[name] = groups["dp_cp"]
                continue
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
            ranks = [rank] if mine is None and name == "embedding" else group_of(rank, all_groups)
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
        return cls(
            tp=tp,
            dp=dp,
            pp=pp,
            rank=rank,
            coords=rank_to_coords(rank, tp, dp, pp, cp),
            groups=groups,
            device=torch.device(device),
            stats=stats,
            cp=cp,
            ep=ep,
        )
