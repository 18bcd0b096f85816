"""Pure rank arithmetic for the tp x dp x pp grid.

Ranks are ordered tp fastest, then dp, then pp:
``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``, so a tensor-parallel group is a run of
consecutive ranks (one node on GPU clusters) and pipeline neighbours are ``tp * dp`` apart.
Nothing here touches torch.distributed; tests drive these functions for many shapes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coords:
    """Position of one rank in the grid."""

    tp: int
    dp: int
    pp: int


def rank_to_coords(rank: int, tp: int, dp: int, pp: int) -> Coords:
    """Grid coordinates of ``rank`` in a ``tp x dp x pp`` world."""
    world = tp * dp * pp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world} (tp={tp} dp={dp} pp={pp})")
    return Coords(tp=rank % tp, dp=(rank // tp) % dp, pp=rank // (tp * dp))


def coords_to_rank(c: Coords, tp: int, dp: int, pp: int) -> int:
    """Inverse of :func:`rank_to_coords`."""
    if not (0 <= c.tp < tp and 0 <= c.dp < dp and 0 <= c.pp < pp):
        raise ValueError(f"{c} is outside the grid tp={tp} dp={dp} pp={pp}")
    return c.tp + tp * (c.dp + dp * c.pp)


def group_ranks(tp: int, dp: int, pp: int) -> dict[str, list[list[int]]]:
    """Every process group of the grid, as lists of global ranks.

    - ``tp``: same (dp, pp); ``dp``: same (tp, pp); ``pp``: same (tp, dp).
    - ``mp`` (model parallel, tp x pp): same dp.
    - ``embedding``: first and last pipeline stage of each (tp, dp) pair, which hold the two copies
      of a tied word embedding (a single rank when pp == 1).
    - ``world``: everyone.
    """
    r = lambda t, d, p: coords_to_rank(Coords(t, d, p), tp, dp, pp)  # noqa: E731
    groups: dict[str, list[list[int]]] = {
        "tp": [[r(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[r(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[r(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "mp": [sorted(r(t, d, p) for p in range(pp) for t in range(tp)) for d in range(dp)],
        "embedding": [sorted({r(t, d, 0), r(t, d, pp - 1)}) for d in range(dp) for t in range(tp)],
        "world": [list(range(tp * dp * pp))],
    }
    return groups


def group_of(rank: int, groups: list[list[int]]) -> list[int]:
    """The one group in ``groups`` that contains ``rank``."""
    for ranks in groups:
        if rank in ranks:
            return ranks
    raise ValueError(f"rank {rank} is in none of the groups {groups}")


def rank_map_table(tp: int, dp: int, pp: int) -> str:
    """A printable table: one line per rank with its tp / dp / pp coordinates."""
    lines = [f"rank map (tp={tp} dp={dp} pp={pp}; tp fastest, then dp, then pp)"]
    lines.append(" rank | tp | dp | pp")
    for rank in range(tp * dp * pp):
        c = rank_to_coords(rank, tp, dp, pp)
        lines.append(f" {rank:4d} | {c.tp:2d} | {c.dp:2d} | {c.pp:2d}")
    return "\n".join(lines)
