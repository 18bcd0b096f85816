"""How a tensor-parallel parameter maps onto its global (unsplit) tensor.

A :class:`TPShard` says which dim is split and that the dim is a concatenation of ``blocks``
(e.g. a fused qkv weight is ``[q | k | v]``), each block split evenly over tp. Rank ``r`` holds
slice ``r`` of every block, concatenated. Initialisation, checkpoints and exports use it to go
between local shards and global tensors, so every layout sees the same global model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPShard:
    """Split of one parameter over a tensor-parallel group of ``tp`` ranks."""

    dim: int
    blocks: tuple[int, ...]

    def local_size(self, tp: int) -> int:
        return sum(b // tp for b in self.blocks)

    def ranges(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """Global ``(start, length)`` ranges along ``dim`` whose concatenation is the shard."""
        out, offset = [], 0
        for b in self.blocks:
            n = b // tp
            out.append((offset + rank * n, n))
            offset += b
        return out

    def take(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """This rank's shard of the global tensor ``full``."""
        parts = [full.narrow(self.dim, s, n) for s, n in self.ranges(rank, tp)]
        return torch.cat(parts, dim=self.dim) if len(parts) > 1 else parts[0]

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The global tensor from every rank's shard (in rank order)."""
        tp = len(shards)
        pieces = []
        for i, b in enumerate(self.blocks):
            n = b // tp
            start = sum(x // tp for x in self.blocks[:i])
            pieces.extend(s.narrow(self.dim, start, n) for s in shards)
        return torch.cat(pieces, dim=self.dim)


def mark_param(
    p: torch.nn.Parameter,
    *,
    shard: TPShard | None = None,
    init: str = "normal",
    std: float = 0.02,
    sequence_parallel: bool = False,
    no_weight_decay: bool = False,
) -> torch.nn.Parameter:
    """Attach megatronish metadata to a parameter.

    - ``shard``: how it is split over tp (None: replicated on every tp rank).
    - ``init``: ``normal`` (with ``std``), ``ones`` or ``zeros``.
    - ``sequence_parallel``: replicated over tp but fed by sequence shards, so its grad must be
      all-reduced over tp (norm weights and row-parallel biases under sp).
    - ``no_weight_decay``: norms and biases.
    """
    p.tp_shard = shard
    p.init_kind = init
    p.init_std = std
    p.sequence_parallel = sequence_parallel
    p.no_weight_decay = no_weight_decay
    return p


def global_shape(p: torch.nn.Parameter, tp: int) -> tuple[int, ...]:
    """Shape of the unsplit parameter."""
    shape = list(p.shape)
    shard = getattr(p, "tp_shard", None)
    if shard is not None:
        shape[shard.dim] = sum(shard.blocks)
    assert shard is None or p.shape[shard.dim] * tp == shape[shard.dim]
    return tuple(shape)
