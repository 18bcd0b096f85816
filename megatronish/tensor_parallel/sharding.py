"""How a tensor-parallel parameter maps onto its global (unsplit) tensor.

A :class:`TPShard` says which dim is split and that the dim is a concatenation of ``blocks``
(e.g. a fused qkv weight is ``[q | k | v]``), each block split evenly over tp. Rank ``r`` holds
slice ``r`` of every block, concatenated. Initialisation, checkpoints and exports use it to go
between local shards and global tensors, so every layout sees the same global model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class ExpertShard:
    """A stack of experts along dim 0: this rank holds experts ``[first, first + local)`` of
    ``num_experts`` (expert parallelism splits the stack over ep ranks)."""

    num_experts: int
    first: int

    def take(self, full: torch.Tensor, local: int) -> torch.Tensor:
        """This rank's experts of the global stack ``full``."""
        return full.narrow(0, self.first, local)


@dataclass(frozen=True)
class ParamInfo:
    """What megatronish knows about a parameter beyond its tensor, one typed record per parameter.

    Initialisation, ZeRO (buckets, weight decay, grad sums), the grad norm and checkpoints read
    it through :func:`param_info`; a new property (an expert index, a context-parallel placement)
    is one field here with its default.
    """

    shard: TPShard | None = None  # how it is split over tp (None: replicated on every tp rank)
    init: str = "normal"  # normal (with std), ones or zeros
    std: float = 0.02
    # Replicated over tp but fed by sequence shards, so its grad is all-reduced over tp (norm
    # weights and row-parallel biases under sequence parallelism).
    sequence_parallel: bool = False
    weight_decay: bool = True  # False for norms and biases
    tied_to: str | None = None  # global name of the parameter this one is a copy of
    experts: ExpertShard | None = None  # a stack of experts, split over ep (dim 0)


UNMARKED = ParamInfo()


def mark_param(p: torch.nn.Parameter, **fields: object) -> torch.nn.Parameter:
    """Attach a :class:`ParamInfo` made of ``fields`` to ``p``; returns ``p``."""
    p.info = ParamInfo(**fields)
    return p


def param_info(p: torch.nn.Parameter) -> ParamInfo:
    """``p``'s record (defaults for a parameter nothing marked)."""
    return getattr(p, "info", UNMARKED)


def update_param_info(p: torch.nn.Parameter, **changes: object) -> None:
    """Change fields of ``p``'s record (e.g. the head's ``tied_to``, known to the model only)."""
    p.info = replace(param_info(p), **changes)


def global_shape(p: torch.nn.Parameter, tp: int) -> tuple[int, ...]:
    """Shape of the unsplit parameter."""
    shape = list(p.shape)
    shard, experts = param_info(p).shard, param_info(p).experts
    if shard is not None:
        shape[shard.dim] = sum(shard.blocks)
    if experts is not None:
        shape[0] = experts.num_experts
    assert shard is None or p.shape[shard.dim] * tp == shape[shard.dim]
    return tuple(shape)
