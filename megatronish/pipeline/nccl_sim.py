"""NCCL's point-to-point semantics as a pure simulation: can these posted groups hang?

The model, per rank a list of groups (what one ``batch_isend_irecv`` posts):

* A rank issues its groups one at a time: the next one only once every send and receive of
  the current one has completed (the engine waits for a group before its next compute, and
  NCCL runs a rank's groups in order on one stream).
* For every ordered pair (src, dst) the issued sends of src to dst and the issued receives of
  dst from src form two FIFOs; the heads match. A send completes only when matched with the
  peer's receive (NCCL's rendezvous for messages larger than its buffers, the worst case), so
  a send at the head of a FIFO blocks its whole group.
* Matched transfers must agree on the message and its shape: order-based matching would
  otherwise swap tensors silently.
* Optionally a rank computes for a given time after each group, which times the bubble of a
  posting plan (latency-free transfers), and for another given time between issuing a group and
  waiting for it (the W ops of a zero-bubble schedule, which need none of its data).

:func:`run_groups` raises :class:`~megatronish.pipeline.ops.DeadlockError` naming every
stuck rank's group when no rank can move, :class:`MismatchError` on a wrong pairing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from megatronish.pipeline.ops import DeadlockError

__all__ = ["DeadlockError", "MismatchError", "P2P", "SimReport", "run_groups"]


@dataclass(frozen=True)
class P2P:
    """One send or receive as posted: ``peer`` is the other rank, ``message`` names the data."""

    kind: str  # "send" | "recv"
    peer: int
    message: Hashable
    shape: tuple[int, ...] = ()

    def __str__(self) -> str:
        way = "to" if self.kind == "send" else "from"
        return f"{self.kind} {self.message} {list(self.shape)} {way} rank {self.peer}"


class MismatchError(RuntimeError):
    """A matched send and receive disagree on the message or its shape."""


@dataclass(frozen=True)
class SimReport:
    """A completed run: groups issued, messages delivered, and per rank the time it finished
    and the time it computed (both 0 without ``compute`` times)."""

    groups: int
    messages: int
    finish: dict[int, float] = field(default_factory=dict)
    busy: dict[int, float] = field(default_factory=dict)


Groups = Mapping[int, Sequence[Sequence[P2P]]]


def _check(groups: Groups, compute: Mapping[int, Sequence[float]] | None) -> None:
    for rank, rank_groups in groups.items():
        if compute is not None and len(compute[rank]) != len(rank_groups):
            raise ValueError(
                f"rank {rank}: {len(compute[rank])} compute times for {len(rank_groups)} groups"
            )
        for group in rank_groups:
            for op in group:
                if op.kind not in ("send", "recv"):
                    raise ValueError(f"rank {rank}: {op} is neither a send nor a receive")
                if op.peer == rank or op.peer not in groups:
                    raise ValueError(f"rank {rank}: {op} names no other rank of {sorted(groups)}")


def run_groups(
    groups: Groups,
    compute: Mapping[int, Sequence[float]] | None = None,
    overlap: Mapping[int, Sequence[float]] | None = None,
) -> SimReport:
    """Run every rank's ``groups`` (rank -> groups in posting order) to completion.

    With ``compute``, rank r computes ``compute[r][i]`` time units after its group i completed
    and then issues group i + 1; with ``overlap`` it also computes ``overlap[r][i]`` right after
    issuing group i, before waiting for it. A transfer completes when both sides have issued it
    (no latency), a group when its last transfer did. That times the bubble of what was posted.
    """
    _check(groups, compute)
    if overlap is not None:
        _check(groups, overlap)
    current = dict.fromkeys(groups, 0)  # index of the group a rank has issued
    left = dict.fromkeys(groups, 0)  # transfers of that group not yet matched
    done: dict[int, set[int]] = {r: set() for r in groups}  # matched transfers of that group
    clock = dict.fromkeys(groups, 0.0)  # when the current group was issued, later completed
    busy = dict.fromkeys(groups, 0.0)
    sends: dict[tuple[int, int], deque] = {}
    recvs: dict[tuple[int, int], deque] = {}
    touched: list[tuple[int, int]] = []
    issued = matched = 0

    def spend(rank: int, times: Mapping[int, Sequence[float]] | None) -> None:
        spent = times[rank][current[rank]] if times is not None else 0.0
        clock[rank] += spent
        busy[rank] += spent

    def run(rank: int) -> None:  # the current group completed: compute, then move on
        spend(rank, compute)
        current[rank] += 1

    def issue(rank: int) -> None:
        nonlocal issued
        rank_groups = groups[rank]
        while current[rank] < len(rank_groups) and not rank_groups[current[rank]]:
            spend(rank, overlap)
            run(rank)  # an empty group completes at once
        if current[rank] == len(rank_groups):
            return
        issued += 1
        done[rank].clear()
        group = rank_groups[current[rank]]
        left[rank] = len(group)
        for i, op in enumerate(group):
            pair = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
            queue = sends if op.kind == "send" else recvs
            queue.setdefault(pair, deque()).append((rank, i, op, clock[rank]))
            touched.append(pair)
        spend(rank, overlap)

    def complete(rank: int, index: int, at: float) -> None:
        done[rank].add(index)
        left[rank] -= 1
        clock[rank] = max(clock[rank], at)
        if left[rank] == 0:
            run(rank)
            issue(rank)

    for rank in groups:
        issue(rank)
    while touched:
        pair = touched.pop()
        out, into = sends.get(pair), recvs.get(pair)
        while out and into:
            (src, i, send, sent_at), (dst, j, recv, posted_at) = out.popleft(), into.popleft()
            if (send.message, send.shape) != (recv.message, recv.shape):
                raise MismatchError(
                    f"rank {src}'s {send} matches rank {dst}'s {recv}: the pair's "
                    "messages are posted in different orders"
                )
            matched += 1
            at = max(sent_at, posted_at)
            complete(src, i, at)
            complete(dst, j, at)
    stuck = [r for r in groups if current[r] < len(groups[r])]
    if stuck:
        raise DeadlockError(
            "p2p groups deadlock: " + "; ".join(_waiting(r, groups, current, done) for r in stuck)
        )
    return SimReport(issued, matched, dict(clock), busy)


def _waiting(
    rank: int, groups: Groups, current: Mapping[int, int], done: Mapping[int, set[int]]
) -> str:
    index = current[rank]
    group = groups[rank][index]
    ops = ", ".join(
        f"{op} ({'done' if i in done[rank] else 'pending'})" for i, op in enumerate(group)
    )
    return f"rank {rank} waits in group {index} of {len(groups[rank])}: [{ops}]"
