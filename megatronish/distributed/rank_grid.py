"""A world of ranks laid out over named axes (Megatron-Core's RankGenerator, pure).

``RankGrid("tp-cp-dp-pp", {"tp": 2, "cp": 1, "dp": 2, "pp": 2})`` orders ranks with the first
axis fastest: ``rank = tp + 2 * (cp + 1 * (dp + 2 * pp))``. A group spanning some axes is the set
of ranks that differ only in those axes. Nothing here touches torch.distributed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankGrid:
    """Ranks laid out over ``order``'s axes (``"tp-cp-dp-pp"``: first fastest) of ``sizes``."""

    order: str
    sizes: Mapping[str, int] = field(hash=False)

    def __post_init__(self) -> None:
        axes = self.order.split("-")
        if len(set(axes)) != len(axes) or set(axes) != set(self.sizes):
            raise ValueError(f"order {self.order!r} must name each axis of {dict(self.sizes)} once")
        if any(not isinstance(n, int) or n < 1 for n in self.sizes.values()):
            raise ValueError(f"axis sizes must be positive integers, got {dict(self.sizes)}")
        object.__setattr__(self, "sizes", {a: self.sizes[a] for a in axes})

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes, fastest first."""
        return tuple(self.sizes)

    @property
    def world_size(self) -> int:
        n = 1
        for size in self.sizes.values():
            n *= size
        return n

    def coords(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of ``rank``, axes fastest first."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ({self})")
        out = {}
        for axis, size in self.sizes.items():
            rank, out[axis] = divmod(rank, size)
        return out

    def rank(self, **coords: int) -> int:
        """The rank at ``coords`` (every axis named; inverse of :meth:`coords`)."""
        if set(coords) != set(self.sizes) or not all(
            0 <= coords[a] < n for a, n in self.sizes.items()
        ):
            raise ValueError(f"{coords} is not a point of the grid {self}")
        rank = 0
        for axis in reversed(self.axes):
            rank = rank * self.sizes[axis] + coords[axis]
        return rank

    def groups(self, axes: str) -> list[list[int]]:
        """Every group spanning ``axes`` (``"dp-cp"``: any order): ranks that differ only in those
        axes, each group ascending, groups in order of their first rank."""
        spanned = set(axes.split("-"))
        if not spanned <= set(self.sizes):
            raise ValueError(f"{axes!r} names an axis outside {self.order!r}")
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(i for a, i in c.items() if a not in spanned)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def group(self, rank: int, axes: str) -> list[int]:
        """The group spanning ``axes`` that holds ``rank``."""
        return next(g for g in self.groups(axes) if rank in g)

    def __str__(self) -> str:
        return " ".join(f"{a}={n}" for a, n in self.sizes.items())
