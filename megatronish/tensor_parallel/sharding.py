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
    """Split of one parameter over a tensor-parallel group of ``tp`` ranks.

    ``heads``: the heads (indivisible pieces) of each block, or empty when every block splits
    evenly over tp. A block of fewer heads than tp ranks is not split below one head: head
    ``j`` of ``n`` is replicated on the ``tp / n`` consecutive ranks ``j tp / n ...`` (key and
    value heads fewer than tp, as Megatron-Core places them).
    """

    dim: int
    blocks: tuple[int, ...]
    heads: tuple[int, ...] = ()

    def parts(self, block: int, tp: int) -> int:
        """Distinct pieces block ``block`` is cut into over ``tp`` ranks."""
        return min(tp, self.heads[block]) if self.heads else tp

    def piece(self, block: int, rank: int, tp: int) -> int:
        """Which piece of block ``block`` rank ``rank`` holds."""
        return rank * self.parts(block, tp) // tp

    def first_copy(self, block: int, rank: int, tp: int) -> bool:
        """Whether ``rank`` holds the first copy of its piece of ``block`` (every rank does
        unless the block's heads are replicated)."""
        return rank % (tp // self.parts(block, tp)) == 0

    def replicates(self, tp: int) -> bool:
        """Whether some block is replicated on several of ``tp`` ranks."""
        return any(self.parts(i, tp) < tp for i in range(len(self.blocks)))

    def local_size(self, tp: int) -> int:
        return sum(b // self.parts(i, tp) for i, b in enumerate(self.blocks))

    def ranges(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """Global ``(start, length)`` ranges along ``dim`` whose concatenation is the shard."""
        out, offset = [], 0
        for i, b in enumerate(self.blocks):
            n = b // self.parts(i, tp)
            out.append((offset + self.piece(i, rank, tp) * n, n))
            offset += b
        return out

    def take(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """This rank's shard of the global tensor ``full``."""
        parts = [full.narrow(self.dim, s, n) for s, n in self.ranges(rank, tp)]
        return torch.cat(parts, dim=self.dim) if len(parts) > 1 else parts[0]

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The global tensor from every rank's shard (in rank order); a replicated piece is
        taken from its first copy."""
        tp = len(shards)
        pieces, start = [], 0
        for i, b in enumerate(self.blocks):
            parts = self.parts(i, tp)
            n = b // parts
            pieces.extend(shards[j * tp // parts].narrow(self.dim, start, n) for j in range(parts))
            start += n
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
    # Some of its shard's blocks are heads replicated over tp ranks (``TPShard.heads``): each
    # copy's grad is partial (its own queries' share), summed over the copies.
    replicated_heads: bool = False
    # Its rows index the vocabulary (the word embedding, the output layer): grads far from low
    # rank (one row per token: the softmax's error, the looked-up rows), which PowerSGD leaves
    # uncompressed unless parallel.powersgd_compress_vocab.
    vocab: bool = False


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
    assert shard is None or p.shape[shard.dim] == shard.local_size(tp)
    return tuple(shape)
