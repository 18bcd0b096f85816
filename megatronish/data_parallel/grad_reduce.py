"""Gradient reductions over dp, launched per bucket and finished in launch order.

A reduction is launched asynchronously as soon as a bucket's grads are complete and finished
(waited for, copied out of a narrower wire dtype, added into the owned grad) in launch order.
Under ZeRO 2/3, whose full-size grad buffers are freed after their reduction, at most
``MAX_IN_FLIGHT`` are outstanding (FSDP2's order): launching one more first finishes the oldest,
so full grads live for the bucket being filled and the one in flight, not for the whole model;
the one in flight when a backward ends is finished there (``ZeroDataParallel.after_compute``).
On NCCL a ``wait`` only orders the compute stream after the reduction; the host does not block.
ZeRO 0/1 keep their grad buffers and finish every reduction at the end of the step (under hybrid
sharding, as ZeRO 2/3, so that each shard's all-reduce over the replicas starts behind it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatronish.data_parallel.compression import CompressedReduction, Compressor
from megatronish.data_parallel.stages import ZeroStage
from megatronish.distributed.comm import NamedWork, ParallelGroup, all_reduce, reduce_scatter_into
from megatronish.distributed.timers import Timers

if TYPE_CHECKING:
    from megatronish.data_parallel.buckets import Bucket

MAX_IN_FLIGHT = 1  # zero 2/3: reductions outstanding while the next bucket fills


@dataclass
class Reduction:
    work: NamedWork | None  # None when it completed on launch (a group of one)
    full: torch.Tensor  # the reduced input: kept alive until the reduction is done
    out: torch.Tensor  # where the collective writes
    into: torch.Tensor  # the owned grad that receives the result
    accumulate: bool  # add into ``into`` (a later microbatch's reduction) instead of copying
    then: Callable[[], None] | None = None  # run once ``into`` holds the result

    @property
    def numel(self) -> int:
        """Elements of the full buffer it holds until finished."""
        return self.full.numel()

    def advance(self) -> None:
        """Nothing between launch and finish (one collective; a compressed reduction may have
        a second one to start here)."""

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.out is not self.into:
            if self.accumulate:
                self.into.add_(self.out)
            else:
                self.into.copy_(self.out)
        if self.then is not None:
            self.then()


class GradReducer:
    """Launches the dp reductions of a ZeRO stage (all-reduce, or reduce-scatter into shards)."""

    def __init__(
        self,
        group: ParallelGroup,
        zero_stage: ZeroStage,
        reduce_dtype: torch.dtype,
        timers: Timers | None = None,
        bounded: bool = False,
        compressor: Compressor | None = None,
    ):
        self.group, self.zero_stage, self.reduce_dtype = group, zero_stage, reduce_dtype
        self.compressor = compressor  # parallel.grad_compression's, or None
        self.compressing = True  # False: the compressor's warm-up steps reduce uncompressed
        self.timers = timers or Timers.off()
        # ``bounded``: finish reductions in flight as zero 2/3 do (hybrid sharding's replica
        # all-reduce starts when its shard's reduction is finished)
        bounded = bounded or zero_stage.shards_grads
        self.max_in_flight = MAX_IN_FLIGHT if bounded else None
        self.in_flight: deque[Reduction | CompressedReduction] = deque()
        self.in_flight_numel = 0  # elements of the full buffers the reductions in flight hold

    def launch(
        self,
        full: torch.Tensor,
        into: torch.Tensor,
        accumulate: bool = False,
        group: ParallelGroup | None = None,
        then: Callable[[], None] | None = None,
        bucket: Bucket | None = None,
    ) -> None:
        """Reduce ``full`` over dp (or ``group``: the expert-data-parallel ranks of an expert
        bucket) into ``into`` (the whole buffer under zero 0, this rank's shard otherwise), added
        to it when ``accumulate``; ``then`` runs when it is finished. With a compressor, the
        compressed reduction of ``bucket``."""
        group, wire = group or self.group, full
        if self.compressor is not None and self.compressing and group.size > 1:
            with self.timers.region(None, f"{self.compressor.kind} grads"):
                reduction = self.compressor.launch(bucket, full, into, accumulate, group)
            reduction.then = then
            self._track(reduction)
            return
        if self.reduce_dtype != full.dtype and group.size > 1:  # reduced in a narrower dtype
            wire = full.to(self.reduce_dtype)
        if not self.zero_stage.reduce_scatters_grads:
            out = wire
            with self.timers.region(None, "all-reduce grads"):
                work = all_reduce(wire, group, async_op=True)
        else:
            direct = wire is full and not accumulate and into.dtype == full.dtype
            out = into if direct else wire.new_empty(into.numel())
            with self.timers.region(None, "reduce-scatter grads"):
                work = reduce_scatter_into(out, wire, group, async_op=True)
        self._track(Reduction(work, wire, out, into, accumulate, then))

    def _track(self, reduction: Reduction | CompressedReduction) -> None:
        self.in_flight.append(reduction)
        self.in_flight_numel += reduction.numel
        while self.max_in_flight is not None and len(self.in_flight) > self.max_in_flight:
            with self.timers.region("grad_reduce_wait", "wait grads"):
                self._finish_oldest()

    def finish_all(self) -> None:
        """Finish every outstanding reduction (in launch order; each one's second collective,
        if any, is started before the first is waited for)."""
        for reduction in self.in_flight:
            reduction.advance()
        while self.in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        # Popped before waiting: a failed wait does not leave the work (and its group) held.
        reduction = self.in_flight.popleft()
        self.in_flight_numel -= reduction.numel
        reduction.advance()
        reduction.finish()


@dataclass
class ReplicaReduction:
    """An all-reduce of a reduced shard over hybrid sharding's replicas, in flight."""

    work: NamedWork | None
    wire: torch.Tensor  # the shard, or its copy in the reduction dtype
    shard: torch.Tensor
    then: Callable[[], None] | None = None  # run once the shard holds the sum

    @classmethod
    def launch(
        cls, shard: torch.Tensor, group: ParallelGroup, reduce_dtype: torch.dtype
    ) -> ReplicaReduction:
        wire = shard if shard.dtype == reduce_dtype else shard.to(reduce_dtype)
        return cls(all_reduce(wire, group, async_op=True), wire, shard)

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.wire is not self.shard:
            self.shard.copy_(self.wire)
        if self.then is not None:
            self.then()
