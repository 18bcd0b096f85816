"""Posting and waiting for one p2p group of a schedule step, with its timers and timeline events.

Before its compute a rank waits for the group's receives (the data it needs). Its sends are
completed before the next group is posted (or at the end of the step): a rank's groups still
run strictly one after the other, as on NCCL's single stream, but the compute between two
groups overlaps the peer's posting of the matching receives (on gloo a send completes only
once that receive is posted; NCCL completes a batch as a unit, so there it waits for the group).

Time is split between the two pipeline timers: posting a group and completing its sends count
as ``pp_send_wait``, waiting for its receives as ``pp_recv_wait`` (posting counts there too when
the group only receives). Each send and receive keeps its own timeline event
(``send_act mb0 c0``): the sends share the posting, the receives the wait (a receive-only group
shares both), one after the other in the group's order, so events never overlap. Profiler
ranges are named after the ops (``send act mb0 chunk0``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatronish.pipeline.p2p import P2PCommunicator, P2PWork, Transfer
from megatronish.pipeline.schedule import Op, message
from megatronish.timers import Timers

Record = Callable[[str, float, float], None]  # (event name, start, end) in perf_counter seconds


class _Labels:
    """Profiler range name of some ops, formatted only when a profile asks for it."""

    def __init__(self, ops: Sequence[Op]):
        self.ops = ops

    def __str__(self) -> str:
        return " + ".join(
            f"{op.kind.replace('_', ' ')} mb{op.microbatch} chunk{op.chunk}" for op in self.ops
        )


@dataclass
class Posted:
    """A group on the wire: its work handle and what ``wait`` needs to account for it."""

    work: P2PWork
    sends: list[Op]
    recvs: list[Op]
    start: float
    posted: float


class GroupPoster:
    """Posts groups through ``comm``; ``record`` receives timeline events, ``timers`` the waits."""

    def __init__(self, comm: P2PCommunicator, record: Record | None = None, timers=None):
        self.comm, self.record = comm, record
        self.region = (timers or Timers.off()).region
        self.sending: Posted | None = None  # the last group, while its sends may be in flight

    def post(self, ops: Sequence[Op], tensors: Sequence[torch.Tensor]) -> Posted | None:
        """Post ``ops`` (send_*/recv_* ops) with their data or buffers; None for no ops.

        The previous group's sends complete first."""
        if not ops:
            return None
        self.finish()
        sends = [op for op in ops if op.kind.startswith("send")]
        recvs = [op for op in ops if op.kind.startswith("recv")]
        transfers = [
            Transfer(op.kind[:4], op.peer, t, message(op))
            for op, t in zip(ops, tensors, strict=True)
        ]
        start = time.perf_counter()
        with self.region(
            "pp_send_wait" if sends else "pp_recv_wait", "{}", _Labels(sends or recvs)
        ):
            work = self.comm.post(transfers)
        return Posted(work, sends, recvs, start, time.perf_counter())

    def wait(self, posted: Posted | None) -> None:
        """Wait for the group's receives, then record its timeline events; its sends complete
        in :meth:`finish`."""
        if posted is None:
            return
        sends, recvs = posted.sends, posted.recvs
        if recvs:
            with self.region("pp_recv_wait", "{}", _Labels(recvs)):
                posted.work.wait_receives()
        self.sending = posted
        if self.record is None:
            return
        end = time.perf_counter()
        recv_start = posted.posted if sends else posted.start
        _share(self.record, sends, posted.start, posted.posted)
        _share(self.record, recvs, recv_start, end)

    def finish(self) -> None:
        """Complete the last group (its sends): before the next group and at the end of a step."""
        posted, self.sending = self.sending, None
        if posted is not None:
            with self.region("pp_send_wait", "{}", _Labels(posted.sends or posted.recvs)):
                posted.work.wait()


def _share(record: Record, ops: list[Op], start: float, end: float) -> None:
    """Record ``ops`` as consecutive equal parts of ``[start, end]`` (they never overlap)."""
    part = (end - start) / max(len(ops), 1)
    for i, op in enumerate(ops):
        record(f"{op.kind} mb{op.microbatch} c{op.chunk}", start + i * part, start + (i + 1) * part)
