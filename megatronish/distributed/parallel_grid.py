"""The job's rank layout: the tp x cp x dp x pp grid, its expert view, and its named groups.

Ranks are ordered tp fastest, then cp, then dp, then pp (Megatron-LM's tp-cp-dp-pp):
``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``, so a tensor-parallel group
is a run of consecutive ranks (one node on GPU clusters), a context-parallel group comes next,
and pipeline neighbours are ``tp * cp * dp`` apart. Expert parallelism is carved out of the
``dp x cp`` ranks that hold the same dense parameters (index ``cp_rank + cp * dp_rank``), ep
fastest, as Megatron-LM carves it out of data parallelism: the expert view is the grid
tp-ep-edp-pp over the same ranks. Under ``parallel.cp_comm_type=a2a_ring`` the cp axis is cut in
two (the cp view, tp-cp_a2a-cp_ring-dp-pp): all-to-all groups of ``cp_a2a_size`` consecutive cp
ranks (a node's share), and rings of the ranks at the same place in every such group
(Megatron-LM's hierarchical context-parallel groups). Under hybrid sharding
(``parallel.zero_shard_size``) the dp axis is cut in two (the ZeRO view, tp-cp-dp_shard-dp_replica-
pp): ZeRO shards over ``cp x zero_shard_size`` consecutive ranks of a dp x cp group (a node) and
the shard groups replicate each other (FSDP2's HSDP). Pure; tests drive it for many shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from megatronish.config.derived import data_parallel_size
from megatronish.distributed.rank_grid import RankGrid

if TYPE_CHECKING:
    from megatronish.config.schema import ParallelConfig

DENSE_ORDER = "tp-cp-dp-pp"
EXPERT_ORDER = "tp-ep-edp-pp"
CP_ORDER = "tp-cp_a2a-cp_ring-dp-pp"
ZERO_ORDER = "tp-cp-dp_shard-dp_replica-pp"

# The named groups, in the order every rank creates them: (view, axes spanned).
# - tp, cp, dp, pp: one axis each; dp_cp: the ranks holding the same parameters (grads are
#   reduced, ZeRO shards spread over them); mp (model parallel): tp x pp.
# - ep: ranks of one dp_cp group holding different experts (they exchange tokens);
#   edp (expert data parallel, dp * cp / ep ranks): those holding the same experts.
# - cp_a2a, cp_ring: a2a_ring's cut of a cp group (consecutive cp ranks exchange heads; the
#   ranks at the same place in each of those groups pass K/V around a ring).
# - zero_shard, zero_replica: hybrid sharding's cut of a dp x cp group: the ranks ZeRO shards
#   over (cp x zero_shard_size consecutive dp ranks), and those holding the same shard.
# - embedding: first and last pipeline stage of each pp group (the two copies of a tied word
#   embedding; a single rank when pp == 1). world: everyone.
GROUP_AXES = {
    "tp": ("dense", "tp"),
    "cp": ("dense", "cp"),
    "cp_a2a": ("cp_view", "cp_a2a"),
    "cp_ring": ("cp_view", "cp_ring"),
    "dp": ("dense", "dp"),
    "dp_cp": ("dense", "dp-cp"),
    "zero_shard": ("zero_view", "dp_shard-cp"),
    "zero_replica": ("zero_view", "dp_replica"),
    "ep": ("expert", "ep"),
    "edp": ("expert", "edp"),
    "pp": ("dense", "pp"),
    "mp": ("dense", "tp-pp"),
    "embedding": ("dense", "pp"),
    "world": ("dense", DENSE_ORDER),
}
GROUP_NAMES = tuple(GROUP_AXES)


@dataclass(frozen=True)
class Coords:
    """Position of one rank in the dense grid."""

    tp: int
    dp: int
    pp: int
    cp: int = 0


@dataclass(frozen=True)
class ParallelGrid:
    """The dense grid (tp-cp-dp-pp), its expert view (tp-ep-edp-pp), its cp view
    (tp-cp_a2a-cp_ring-dp-pp) and its ZeRO view (tp-cp-dp_shard-dp_replica-pp) of the same
    world."""

    dense: RankGrid
    expert: RankGrid
    cp_view: RankGrid
    zero_view: RankGrid

    @classmethod
    def of(
        cls,
        *,
        tp: int = 1,
        cp: int = 1,
        dp: int = 1,
        pp: int = 1,
        ep: int = 1,
        cp_a2a: int = 1,
        zero_shard: int | None = None,
    ) -> ParallelGrid:
        """The grid of these degrees; ``ep`` must divide ``dp * cp``, ``cp_a2a`` (the cp ranks
        of an all-to-all group under a2a_ring; 1 otherwise) must divide ``cp``, ``zero_shard``
        (the dp ranks of a hybrid-sharding group; None: all of dp) must divide ``dp``."""
        if ep < 1 or (dp * cp) % ep:
            raise ValueError(f"ep={ep} must divide dp * cp = {dp} * {cp}")
        if cp_a2a < 1 or cp % cp_a2a:
            raise ValueError(f"cp_a2a={cp_a2a} must divide cp = {cp}")
        shard = dp if zero_shard is None else zero_shard
        if shard < 1 or dp % shard:
            raise ValueError(f"zero_shard={zero_shard} must divide dp = {dp}")
        dense = RankGrid(DENSE_ORDER, {"tp": tp, "cp": cp, "dp": dp, "pp": pp})
        expert = RankGrid(EXPERT_ORDER, {"tp": tp, "ep": ep, "edp": dp * cp // ep, "pp": pp})
        cut = {"tp": tp, "cp_a2a": cp_a2a, "cp_ring": cp // cp_a2a, "dp": dp, "pp": pp}
        hybrid = {"tp": tp, "cp": cp, "dp_shard": shard, "dp_replica": dp // shard, "pp": pp}
        return cls(
            dense=dense,
            expert=expert,
            cp_view=RankGrid(CP_ORDER, cut),
            zero_view=RankGrid(ZERO_ORDER, hybrid),
        )

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> ParallelGrid:
        """The grid of a config's validated ``parallel`` section in a world of ``world_size``."""
        p = parallel
        dp = data_parallel_size(p, world_size)
        cp_a2a = (getattr(p, "cp_a2a_size", None) or 1) if p.cp_comm_type == "a2a_ring" else 1
        zero_shard = getattr(p, "zero_shard_size", None)
        return cls.of(
            tp=p.tp, cp=p.cp, dp=dp, pp=p.pp, ep=p.ep, cp_a2a=cp_a2a, zero_shard=zero_shard
        )

    @cached_property
    def _sizes(self) -> dict[str, int]:
        return {
            **self.dense.sizes,
            **self.expert.sizes,
            **self.cp_view.sizes,
            **self.zero_view.sizes,
        }

    def size(self, axis: str) -> int:
        """The degree of ``axis`` (tp, cp, dp, pp, ep, edp, cp_a2a, cp_ring, dp_shard or
        dp_replica)."""
        if axis not in self._sizes:
            raise ValueError(f"no axis {axis!r}: the axes are {', '.join(self._sizes)}")
        return self._sizes[axis]

    @property
    def world_size(self) -> int:
        return self.dense.world_size

    def communicator(self, name: str) -> str:
        """The group whose communicator group ``name`` shares (CommStats counts it under that
        name): dp for dp_cp when cp = 1, dp_cp's for edp when ep = 1, cp for cp_a2a or
        cp_ring when it spans the whole cp group (the same ranks), dp_cp's for zero_shard
        without hybrid sharding; else ``name`` (hybrid sharding's groups keep their own, so
        CommStats and the planner never count ZeRO's traffic as cp's or dp's)."""
        if name == "dp_cp" and self.size("cp") == 1:
            return "dp"
        if name == "zero_shard" and self.size("dp_replica") == 1:
            return self.communicator("dp_cp")
        if name in ("cp_a2a", "cp_ring") and self.size(name) == self.size("cp"):
            return "cp"
        if name == "edp" and self.size("ep") == 1:
            return self.communicator("dp_cp")
        return name

    def coords(self, rank: int) -> Coords:
        """``rank``'s place in the dense grid."""
        return Coords(**self.dense.coords(rank))

    def groups(self, name: str) -> list[list[int]]:
        """Every group called ``name`` (one of :data:`GROUP_NAMES`), as lists of global ranks."""
        if name not in GROUP_AXES:
            raise ValueError(f"no group {name!r}: the groups are {', '.join(GROUP_NAMES)}")
        view, axes = GROUP_AXES[name]
        groups = getattr(self, view).groups(axes)
        if name == "embedding":
            return [sorted({g[0], g[-1]}) for g in groups]
        return groups


def rank_map_table(grid: ParallelGrid) -> str:
    """A printable table: one line per rank with its tp / (cp /) dp / pp coordinates, and its
    ep / edp coordinates when experts are split (``ep > 1``)."""
    cp, ep = grid.size("cp"), grid.size("ep")
    order = "tp fastest, then cp, then dp, then pp" if cp > 1 else "tp fastest, then dp, then pp"
    names = ["tp", "cp", "dp", "pp"] if cp > 1 else ["tp", "dp", "pp"]
    shape = " ".join(f"{a}={grid.size(a)}" for a in names)
    if ep > 1:
        shape += f" ep={ep}"
        order += "; ep carved out of dp x cp"
    columns = names + (["ep", "edp"] if ep > 1 else [])
    if 1 < grid.size("cp_a2a") < cp:
        shape += f" cp_a2a={grid.size('cp_a2a')}"
        order += "; cp cut into a2a groups and rings"
        columns += ["cp_a2a", "cp_ring"]
    if grid.size("dp_replica") > 1:
        shape += f" zero_shard={grid.size('dp_shard')}"
        order += "; dp cut into ZeRO shard groups and their replicas"
        columns += ["dp_shard", "dp_replica"]
    lines = [f"rank map ({shape}; {order})", " rank | " + " | ".join(columns)]
    for rank in range(grid.world_size):
        coords = (
            grid.dense.coords(rank)
            | grid.expert.coords(rank)
            | grid.cp_view.coords(rank)
            | grid.zero_view.coords(rank)
        )
        lines.append(f" {rank:4d} | " + " | ".join(f"{coords[a]:2d}" for a in columns))
    return "\n".join(lines)
