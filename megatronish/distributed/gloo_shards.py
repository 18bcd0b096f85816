"""ZeRO's flat all-gather and reduce-scatter on gloo, as one broadcast / reduce per member.

gloo runs ``all_gather_into_tensor`` through two temporary buffers the size of the gathered
output, and ``reduce_scatter_tensor`` through a copy of its whole input that lives until the op
completes. One broadcast from each member into its slice of the output, and one reduce of each
slice onto its owner, produce the same results in place, with no temporary at all, and in
about half the time on 2-4 CPU ranks (docs/benchmarks.md). NCCL keeps its native collectives,
which allocate nothing on the host.

The reduces leave the input's slices of other members undefined (gloo reduces in place);
ZeRO's callers use only their own slice of a reduced buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatronish.distributed.comm import ParallelGroup


class WorkGroup:
    """Asynchronous ops waited for as one, then ``after()`` (a finishing copy)."""

    def __init__(self, works: list[dist.Work], after: Callable[[], object] | None = None):
        self.works, self.after = works, after

    def wait(self) -> bool:
        works, self.works = self.works, []
        for work in works:
            work.wait()
        if self.after is not None:
            after, self.after = self.after, None
            after()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def decomposes(group: ParallelGroup) -> bool:
    """Whether ``group`` (a ParallelGroup) runs ZeRO's flat collectives member by member."""
    return group.decompose_gloo_shards and dist.get_backend(group.handle()) == "gloo"


def gather_by_broadcasts(
    out: torch.Tensor,
    shard: torch.Tensor,
    group: ParallelGroup,
    async_op: bool,
    sizes: list[int] | None = None,
) -> WorkGroup | None:
    """``out`` = every member's ``shard`` in member order (all-gather along dim 0); ``sizes``:
    each member's rows when they differ (else equal slices)."""
    slices = out.chunk(group.size) if sizes is None else out.split(sizes)
    mine = slices[group.rank]
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard)
    pg = group.handle()
    works = [
        dist.broadcast(s, src=group.global_rank(i), group=pg, async_op=True)
        for i, s in enumerate(slices)
    ]
    work = WorkGroup(works)
    if async_op:
        return work
    work.wait()
    return None


def scatter_by_reduces(
    out: torch.Tensor,
    full: torch.Tensor,
    group: ParallelGroup,
    async_op: bool,
    sizes: list[int] | None = None,
) -> WorkGroup | None:
    """``out`` = the sum over members of this member's slice of ``full`` (a reduce-scatter along
    dim 0); ``sizes``: each member's rows when they differ (else equal slices)."""
    slices = full.chunk(group.size) if sizes is None else full.split(sizes)
    mine = slices[group.rank]
    pg = group.handle()
    works = [
        dist.reduce(s, dst=group.global_rank(i), group=pg, async_op=True)
        for i, s in enumerate(slices)
    ]
    after = None if mine.data_ptr() == out.data_ptr() else (lambda: out.copy_(mine))
    work = WorkGroup(works, after)
    if async_op:
        return work
    work.wait()
    return None
