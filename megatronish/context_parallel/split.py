"""Which tokens of a sequence each context-parallel rank holds (pure rank arithmetic).

The sequence is cut into ``2 * cp`` equal chunks; cp rank ``r`` holds chunks ``r`` and
``2cp - 1 - r``. Under causal attention a token's work grows with its position, so pairing an
early chunk with a late one gives every rank the same work (Megatron-LM's load balancing).
"""

from __future__ import annotations

import torch


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 * cp``) that cp rank ``rank`` holds, in local order."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside a cp group of {cp}")
    return rank, 2 * cp - 1 - rank


def local_positions(seq: int, cp: int, rank: int) -> list[int]:
    """Global positions of this rank's tokens, in local order."""
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2*cp = {2 * cp}")
    c = seq // (2 * cp)
    return [j * c + i for j in chunk_ids(cp, rank) for i in range(c)]


def split_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim`` (a whole sequence), concatenated."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[j] for j in chunk_ids(cp, rank)], dim=dim).contiguous()


def natural_order(cp: int) -> list[int]:
    """For each chunk of the sequence in order, its index in the rank-major gather
    ``[rank 0 chunk a, rank 0 chunk b, rank 1 chunk a, ...]``."""
    return [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]


def rank_major_order(cp: int) -> list[int]:
    """The inverse of :func:`natural_order`: for each gathered chunk, its chunk index."""
    order = [0] * (2 * cp)
    for g, i in enumerate(natural_order(cp)):
        order[i] = g
    return order
