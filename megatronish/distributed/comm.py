"""Collectives over a :class:`ParallelGroup`, counted by :class:`CommStats`.

Every collective in megatronish goes through this module, so communication volume can be
measured per group and per op and compared with the analytic volume in tests. A group of size 1
short-circuits every op (no process group is needed for a single process).

Byte accounting (per call, on the calling rank): ``all_reduce`` and ``broadcast`` count the
tensor; ``all_gather`` counts the gathered (full) output; ``reduce_scatter`` counts the full input;
``send`` / ``recv`` count the tensor.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; keep one spelling that works from torch 2.6 on.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class CommStats:
    """Calls and bytes per (group name, op) on this rank."""

    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    enabled: bool = True

    def record(self, group: str, op: str, nbytes: int) -> None:
        if self.enabled:
            self.calls[(group, op)] += 1
            self.bytes[(group, op)] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def summary(self) -> dict[str, dict[str, int]]:
        """``{"group/op": {"calls": n, "bytes": b}}``, sorted by key."""
        keys = sorted(self.calls)
        return {
            f"{g}/{o}": {"calls": self.calls[(g, o)], "bytes": self.bytes[(g, o)]} for g, o in keys
        }


@dataclass
class ParallelGroup:
    """A process group together with this rank's place in it.

    ``ranks`` are global ranks; ``rank`` is this process's index in ``ranks``. ``pg`` is None when
    the group has a single member.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None = None
    stats: CommStats | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        return self.ranks[index]

    def _record(self, op: str, t: torch.Tensor, numel: int | None = None) -> None:
        if self.stats is not None:
            n = t.numel() if numel is None else numel
            self.stats.record(self.name, op, n * t.element_size())


def single_group(name: str, rank: int = 0, stats: CommStats | None = None) -> ParallelGroup:
    """A group of one: every op on it is the identity."""
    return ParallelGroup(name=name, ranks=(rank,), rank=0, pg=None, stats=stats)


def all_reduce(t: torch.Tensor, group: ParallelGroup, op: str = "sum", async_op: bool = False):
    """In-place all-reduce; returns the tensor (or a work handle when ``async_op``)."""
    if group.size == 1:
        return None if async_op else t
    group._record("all_reduce", t)
    work = dist.all_reduce(t, op=_OPS[op], group=group.pg, async_op=async_op)
    return work if async_op else t


def all_gather_dim0(t: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Concatenate every rank's ``t`` along dim 0 (equal shapes)."""
    if group.size == 1:
        return t
    t = t.contiguous()
    out = torch.empty((group.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    group._record("all_gather", out)
    _all_gather_single(out, t, group=group.pg)
    return out


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: ParallelGroup, async_op=False):
    """All-gather flat ``shard``s into the preallocated flat ``out`` (ZeRO parameter gather)."""
    if group.size == 1:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return None
    group._record("all_gather", out)
    return _all_gather_single(out, shard, group=group.pg, async_op=async_op)


def reduce_scatter_dim0(t: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Sum ``t`` over the group and keep this rank's slice of dim 0."""
    if group.size == 1:
        return t
    t = t.contiguous()
    if t.shape[0] % group.size:
        raise ValueError(f"dim 0 ({t.shape[0]}) is not divisible by {group.name} size {group.size}")
    out = torch.empty((t.shape[0] // group.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
    group._record("reduce_scatter", t)
    _reduce_scatter_single(out, t, group=group.pg)
    return out


def reduce_scatter_into(
    out: torch.Tensor, full: torch.Tensor, group: ParallelGroup, async_op=False
):
    """Reduce-scatter flat ``full`` into the flat ``out`` shard (ZeRO gradient reduction)."""
    if group.size == 1:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full)
        return None
    group._record("reduce_scatter", full)
    return _reduce_scatter_single(out, full, group=group.pg, async_op=async_op)


def broadcast(t: torch.Tensor, group: ParallelGroup, src_index: int = 0) -> torch.Tensor:
    """Broadcast ``t`` in place from the member at ``src_index``."""
    if group.size == 1:
        return t
    group._record("broadcast", t)
    dist.broadcast(t, src=group.global_rank(src_index), group=group.pg)
    return t


def isend(t: torch.Tensor, group: ParallelGroup, peer: int):
    """Asynchronous send to member ``peer`` of ``group``; returns the work handle."""
    group._record("send", t)
    return dist.isend(t, dst=group.global_rank(peer), group=group.pg)


def irecv(t: torch.Tensor, group: ParallelGroup, peer: int):
    """Asynchronous receive into ``t`` from member ``peer`` of ``group``."""
    group._record("recv", t)
    return dist.irecv(t, src=group.global_rank(peer), group=group.pg)
