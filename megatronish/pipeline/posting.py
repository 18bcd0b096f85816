"""Posting and waiting for one p2p group of a schedule step, with its timers and timeline events.

Time spent on a group is split between the two pipeline timers: posting it counts as
``pp_send_wait`` when it holds a send, waiting for it as ``pp_recv_wait`` when it holds a
receive (the next compute needs that data); a group of one kind counts both parts to that
kind. Each send and receive keeps its own timeline event (``send_act mb0 c0``): the sends share
the posting, the receives the wait (a group of one kind shares both), one after the other in
the group's order, so events never overlap. Profiler ranges are named after the ops
(``send act mb0 chunk0``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatronish.distributed.p2p import P2PCommunicator, P2PWork, Transfer
from megatronish.distributed.timers import Timers
from megatronish.pipeline.ops import Op, message

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

    def __init__(
        self, comm: P2PCommunicator, record: Record | None = None, timers: Timers | None = None
    ):
        self.comm, self.record = comm, record
        self.region = (timers or Timers.off()).region

    def post(self, ops: Sequence[Op], tensors: Sequence[torch.Tensor]) -> Posted | None:
        """Post ``ops`` (send_*/recv_* ops) with their data or buffers; None for no ops."""
        if not ops:
            return None
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

    def wait(self, posted: Posted | None, since: float | None = None) -> None:
        """Wait for the whole group, then record its timeline events. ``since``: when the rank
        began waiting, if it computed after posting (a zero-bubble schedule's W): the group's
        events then start there, not over the W."""
        if posted is None:
            return
        sends, recvs = posted.sends, posted.recvs
        with self.region(
            "pp_recv_wait" if recvs else "pp_send_wait", "{}", _Labels(recvs or sends)
        ):
            posted.work.wait()
        if self.record is None:
            return
        end = time.perf_counter()
        if since is None:
            send_end = posted.posted if recvs else end
            recv_start = posted.posted if sends else posted.start
            _share(self.record, sends, posted.start, send_end)
        else:  # the sends' posting, then (after the W) the wait; sends alone: their wait
            recv_start = since
            if recvs:
                _share(self.record, sends, posted.start, posted.posted)
            else:
                _share(self.record, sends, since, end)
        _share(self.record, recvs, recv_start, end)


def _share(record: Record, ops: list[Op], start: float, end: float) -> None:
    """Record ``ops`` as consecutive equal parts of ``[start, end]`` (they never overlap)."""
    part = (end - start) / max(len(ops), 1)
    for i, op in enumerate(ops):
        record(f"{op.kind} mb{op.microbatch} c{op.chunk}", start + i * part, start + (i + 1) * part)
