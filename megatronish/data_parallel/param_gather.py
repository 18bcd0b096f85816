"""When ZeRO's parameters are all-gathered over dp, and when ZeRO 3 frees them again.

ZeRO 3 (FSDP2's order): a unit's (block's) full parameters are gathered just before the first of
its modules runs forward, while the all-gather of the next unit in forward order starts
(prefetch); they are freed after its last module's forward. In backward the same happens in
reverse order, from the moment the gradient of a module's output arrives, and each of a unit's
buckets is freed as soon as all of its parameters have received their gradients (the unit's
last bucket frees the unit). So a rank holds its shards plus about two units. A recomputed
forward (activation checkpointing) inside backward gathers the units it recomputes (without
prefetch) and keeps them until their backward is done. The unit holding the loss stays
gathered from its forward to its backward, which follows next; anything else a chunk's compute
left gathered is freed when the compute ends (``after_compute``). ``keep_gathered`` keeps
every gathered unit until the end of the step instead (fewer gathers, more memory).

ZeRO 1/2 (Megatron-LM's overlap_param_gather): the all-gathers of the updated parameters are
started after the optimizer step, in forward order, and each unit waits only for the buckets
that hold its parameters before its first forward of the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from megatronish.data_parallel.param_units import ParamUnit, Visit, install_visit_hooks
from megatronish.data_parallel.stages import ZeroStage
from megatronish.distributed.comm import ParallelGroup, all_gather_into
from megatronish.distributed.timers import Timers
from megatronish.tensor_parallel.mappings import in_backward

if TYPE_CHECKING:
    from megatronish.data_parallel.buckets import Bucket


def resize_storage(t: torch.Tensor, numel: int) -> None:
    """Give ``t``'s storage room for ``numel`` elements (0 frees it; views stay valid)."""
    t.untyped_storage().resize_(numel * t.element_size())


class ParamGatherer:
    """Gathers, prefetches and frees the units of a rank's chunks (see the module docstring)."""

    def __init__(
        self,
        units_of: list[list[ParamUnit]],
        visits_of: list[list[Visit]],
        group: ParallelGroup,
        zero_stage: ZeroStage,
        keep_gathered: bool = False,
        timers: Timers | None = None,
        before_gather: Callable[[Bucket], None] | None = None,
    ):
        self.units_of, self.group, self.zero_stage = units_of, group, zero_stage
        # called before a bucket's shard is gathered (offload: waits for its copy up)
        self.before_gather = before_gather or (lambda b: None)
        self.keep_gathered = keep_gathered
        self.timers = timers or Timers.off()
        self.unit_of_param = {id(p): u for us in units_of for u in us for p in u.params}
        self.bucket_of_param = {
            id(p): b for us in units_of for u in us for b in u.buckets for _, p in b.params
        }
        for units in units_of:
            for u in units:
                u.gathered = not zero_stage.shards_params
                u.grads_pending = len(u.named_params)
        self.handles = [
            h
            for visits in visits_of
            for h in install_visit_hooks(visits, self, after=zero_stage.shards_params)
        ]
        self.gathered_numel = self.peak_gathered_numel = 0  # zero 3 accounting

    @property
    def units(self) -> list[ParamUnit]:
        return [u for us in self.units_of for u in us]

    # -- zero 3 -----------------------------------------------------------------------------
    @torch.no_grad()
    def start_gather(self, unit: ParamUnit) -> None:
        """Start gathering ``unit``'s full params (asynchronously); no-op when gathered."""
        if unit.gathered:
            return
        with self.timers.region(None, "all-gather params chunk{} unit{}", unit.chunk, unit.index):
            for b in unit.buckets:
                resize_storage(b.param_flat, b.numel)
                b.extra["grads_left"] = len(b.params)
                self.before_gather(b)
                work = all_gather_into(
                    b.param_flat, b.param_shard, b.group or self.group, async_op=True
                )
                if work is not None:
                    unit.works.append(work)
        unit.gathered = True
        self.gathered_numel += unit.numel
        self.peak_gathered_numel = max(self.peak_gathered_numel, self.gathered_numel)

    def wait(self, unit: ParamUnit) -> None:
        """Block until ``unit``'s pending all-gathers are done."""
        if not unit.works:
            return
        works, unit.works = unit.works, []
        with self.timers.region(
            "param_gather", "wait params chunk{} unit{}", unit.chunk, unit.index
        ):
            for work in works:
                work.wait()

    def ensure(self, unit: ParamUnit) -> None:
        """``unit``'s full params, ready to use."""
        self.start_gather(unit)
        self.wait(unit)

    def release(self, unit: ParamUnit) -> None:
        """Free ``unit``'s full params (zero 3)."""
        unit.grads_pending = len(unit.named_params)
        if not self.zero_stage.shards_params or not unit.gathered:
            return
        self.wait(unit)  # a buffer an all-gather still writes is never freed
        for b in unit.buckets:
            self._free_bucket(b)
        unit.gathered = False

    def _free_bucket(self, b: Bucket) -> None:
        if b.param_flat.untyped_storage().nbytes():
            resize_storage(b.param_flat, 0)
            self.gathered_numel -= b.numel

    # -- hooks (param_units.install_visit_hooks) ----------------------------------------------
    def before_forward(self, visits: list[Visit], i: int) -> None:
        unit = visits[i].unit
        if not self.zero_stage.shards_params:
            self.wait_updated(unit)
            return
        self.ensure(unit)
        if i + 1 < len(visits) and not in_backward():  # a recompute needs no later unit
            self.start_gather(visits[i + 1].unit)

    def after_forward(self, visits: list[Visit], i: int) -> None:
        if not self.zero_stage.shards_params or self.keep_gathered or not visits[i].last:
            return
        if in_backward():  # a recomputed forward: its backward comes next
            return
        if torch.is_grad_enabled() and visits[i].unit.holds_loss:
            return  # the loss's backward comes next
        self.release(visits[i].unit)

    def before_backward(self, visits: list[Visit], i: int) -> None:
        if not self.zero_stage.shards_params:
            return
        self.ensure(visits[i].unit)
        if i > 0:
            self.start_gather(visits[i - 1].unit)

    def grad_ready(self, p: torch.nn.Parameter) -> None:
        """``p``'s gradient of the running backward is accumulated (a post-accumulate hook)."""
        unit = self.unit_of_param.get(id(p))
        if unit is None:
            return
        unit.grads_pending -= 1
        if unit.grads_pending == 0:
            unit.grads_pending = len(unit.named_params)
            if not self.keep_gathered:
                self.release(unit)
            return
        bucket = self.bucket_of_param[id(p)]
        bucket.extra["grads_left"] -= 1
        if bucket.extra["grads_left"] == 0 and unit.gathered and not self.keep_gathered:
            self.wait(unit)
            self._free_bucket(bucket)  # its params' grads are in: the rest of the unit runs on

    # -- engine hooks -------------------------------------------------------------------------
    def prefetch(self, chunk_index: int, kind: str) -> None:
        """Start gathering the unit a compute of ``kind`` ("fwd" / "bwd") on the chunk needs
        first, e.g. while the pipeline waits for that compute's input."""
        if not self.zero_stage.shards_params or not self.units_of[chunk_index]:
            return
        units = self.units_of[chunk_index]
        self.start_gather(units[0] if kind == "fwd" else units[-1])

    def after_compute(self, chunk_index: int, kind: str) -> None:
        """A forward or backward of the chunk ended: free what it left gathered (except the
        loss's unit after a training forward, and everything under ``keep_gathered``)."""
        if not self.zero_stage.shards_params or self.keep_gathered:
            return
        for unit in self.units_of[chunk_index]:
            if kind == "fwd" and torch.is_grad_enabled() and unit.holds_loss:
                continue
            self.release(unit)

    def release_all(self) -> None:
        """Free every gathered unit (end of a step or an evaluation)."""
        for unit in self.units:
            self.release(unit)

    def gather_all(self, chunk_index: int) -> None:
        """Materialise all of a chunk's params (for readers outside a step)."""
        for unit in self.units_of[chunk_index]:
            self.start_gather(unit)
        for unit in self.units_of[chunk_index]:
            self.wait(unit)

    # -- zero 1/2: the gathers after the update -----------------------------------------------
    def start_updated_gather(self, buckets: Iterable[Bucket]) -> None:
        """Start all-gathering every bucket's updated shard into the full params (in place),
        in the order the buckets are listed."""
        with self.timers.region("param_gather", "all-gather params"):
            for b in buckets:
                self.before_gather(b)
                work = all_gather_into(
                    b.param_flat, b.param_shard, b.group or self.group, async_op=True
                )
                b.extra["gather_work"] = work

    def wait_updated(self, unit: ParamUnit | None = None) -> None:
        """Wait for the after-update gathers of ``unit``'s buckets (every bucket: None)."""
        buckets = (
            unit.buckets
            if unit is not None
            else {id(b): b for u in self.units for b in u.buckets}.values()
        )
        works = [w for b in buckets if (w := b.extra.pop("gather_work", None)) is not None]
        if works:
            with self.timers.region("param_gather", "wait updated params"):
                for work in works:
                    work.wait()
