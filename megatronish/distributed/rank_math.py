"""Pure rank arithmetic for the tp x cp x dp x pp grid.

Ranks are ordered tp fastest, then cp, then dp, then pp (Megatron-LM's tp-cp-dp-pp):
``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``, so a tensor-parallel group
is a run of consecutive ranks (one node on GPU clusters), a context-parallel group comes next,
and pipeline neighbours are ``tp * cp * dp`` apart. With cp = 1 this is the 3D order
``tp_rank + tp * (dp_rank + dp * pp_rank)``. Nothing here touches torch.distributed; tests drive
these functions for many shapes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coords:
    """Position of one rank in the grid."""

    tp: int
    dp: int
    pp: int
    cp: int = 0


def rank_to_coords(rank: int, tp: int, dp: int, pp: int, cp: int = 1) -> Coords:
    """Grid coordinates of ``rank`` in a ``tp x cp x dp x pp`` world."""
    world = tp * cp * dp * pp
    if not 0 <= rank < world:
        raise ValueError(
            f"rank {rank} is outside a world of {world} (tp={tp} cp={cp} dp={dp} pp={pp})"
        )
    return Coords(
        tp=rank % tp, cp=(rank // tp) % cp, dp=(rank // (tp * cp)) % dp, pp=rank // (tp * cp * dp)
    )


def coords_to_rank(c: Coords, tp: int, dp: int, pp: int, cp: int = 1) -> int:
    """Inverse of :func:`rank_to_coords`."""
    if not (0 <= c.tp < tp and 0 <= c.cp < cp and 0 <= c.dp < dp and 0 <= c.pp < pp):
        raise ValueError(f"{c} is outside the grid tp={tp} cp={cp} dp={dp} pp={pp}")
    return c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp))


def expert_coords(c: Coords, cp: int, ep: int) -> tuple[int, int]:
    """``(ep rank, expert-data-parallel rank)`` of a rank: expert parallelism is carved out of
    the ``dp x cp`` ranks that hold the same dense parameters (index ``cp_rank + cp * dp_rank``),
    ep fastest, as Megatron-LM carves it out of data parallelism."""
    i = c.cp + cp * c.dp
    return i % ep, i // ep


def group_ranks(tp: int, dp: int, pp: int, cp: int = 1, ep: int = 1) -> dict[str, list[list[int]]]:
    """Every process group of the grid, as lists of global ranks.

    - ``tp``: same (cp, dp, pp); ``cp``: same (tp, dp, pp); ``dp``: same (tp, cp, pp);
      ``pp``: same (tp, cp, dp).
    - ``dp_cp``: same (tp, pp): the ranks that hold the same parameters (replicated over dp and
      cp), over which gradients are reduced and ZeRO shards are spread.
    - ``mp`` (model parallel, tp x pp): same (cp, dp).
    - ``embedding``: first and last pipeline stage of each (tp, cp, dp), which hold the two copies
      of a tied word embedding (a single rank when pp == 1).
    - ``ep``: ``ep`` consecutive members of a ``dp_cp`` group; they hold different experts
      and exchange tokens (all-to-all). ``edp`` (expert data parallel, ``dp*cp/ep`` ranks): the
      members of a ``dp_cp`` group with the same ep rank, which hold the same experts.
    - ``world``: everyone.
    """
    grid = [
        (t, c, d, p) for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)
    ]

    def r(t: int, c: int, d: int, p: int) -> int:
        return coords_to_rank(Coords(tp=t, cp=c, dp=d, pp=p), tp, dp, pp, cp)

    def by(key) -> list[list[int]]:
        """Ranks grouped by ``key(t, c, d, p)``, groups in order of their first rank."""
        groups: dict[tuple, list[int]] = {}
        for t, c, d, p in grid:
            groups.setdefault(key(t, c, d, p), []).append(r(t, c, d, p))
        return list(groups.values())

    return {
        "tp": by(lambda t, c, d, p: (c, d, p)),
        "cp": by(lambda t, c, d, p: (t, d, p)),
        "dp": by(lambda t, c, d, p: (t, c, p)),
        "dp_cp": by(lambda t, c, d, p: (t, p)),
        "ep": by(lambda t, c, d, p: (t, p, (c + cp * d) // ep)),
        "edp": by(lambda t, c, d, p: (t, p, (c + cp * d) % ep)),
        "pp": by(lambda t, c, d, p: (t, c, d)),
        "mp": by(lambda t, c, d, p: (c, d)),
        "embedding": [
            sorted({r(t, c, d, 0), r(t, c, d, pp - 1)})
            for d in range(dp)
            for c in range(cp)
            for t in range(tp)
        ],
        "world": [list(range(tp * cp * dp * pp))],
    }


def group_of(rank: int, groups: list[list[int]]) -> list[int]:
    """The one group in ``groups`` that contains ``rank``."""
    for ranks in groups:
        if rank in ranks:
            return ranks
    raise ValueError(f"rank {rank} is in none of the groups {groups}")


def rank_map_table(tp: int, dp: int, pp: int, cp: int = 1, ep: int = 1) -> str:
    """A printable table: one line per rank with its tp / (cp /) dp / pp coordinates, and its
    ep / edp coordinates when experts are split (``ep > 1``)."""
    order = "tp fastest, then cp, then dp, then pp" if cp > 1 else "tp fastest, then dp, then pp"
    shape = f"tp={tp} cp={cp} dp={dp} pp={pp}" if cp > 1 else f"tp={tp} dp={dp} pp={pp}"
    names = ["tp", "cp", "dp", "pp"] if cp > 1 else ["tp", "dp", "pp"]
    if ep > 1:
        shape += f" ep={ep}"
        order += "; ep carved out of dp x cp"
        names += ["ep", "edp"]
    lines = [f"rank map ({shape}; {order})", " rank | " + " | ".join(names)]
    for rank in range(tp * cp * dp * pp):
        c = rank_to_coords(rank, tp, dp, pp, cp)
        cells = [c.tp, c.cp, c.dp, c.pp] if cp > 1 else [c.tp, c.dp, c.pp]
        if ep > 1:
            cells += list(expert_coords(c, cp, ep))
        lines.append(f" {rank:4d} | " + " | ".join(f"{v:2d}" for v in cells))
    return "\n".join(lines)
