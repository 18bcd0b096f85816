"""NCCL's point-to-point semantics as a pure simulation: can these posted groups hang?

The model, per rank a program of events (:func:`run_programs`): post a group (what one
``batch_isend_irecv`` posts), wait for one, compute.

* A rank's posted groups run one after the other: a group's transfers start only once the
  previous group completed, whether or not the rank waited for it (NCCL runs a rank's groups
  in order on one stream). The rank itself blocks only where it waits.
* For every ordered pair (src, dst) the started sends of src to dst and the started receives of
  dst from src form two FIFOs; the heads match. A send completes only when matched with the
  peer's receive (NCCL's rendezvous for messages larger than its buffers, the worst case), so
  a send at the head of a FIFO blocks its whole group and every group behind it.
* Matched transfers must agree on the message and its shape: order-based matching would
  otherwise swap tensors silently.
* Every posted group must complete. Computes take given times, which times the bubble of a
  posting plan (latency-free transfers).

:func:`run_groups` is the special case of a rank waiting for each group before its next
compute (optionally computing between issuing a group and waiting for it: the W ops of a
zero-bubble schedule, which need none of its data). Both raise
:class:`~megatronish.pipeline.ops.DeadlockError` naming every stuck rank's group when no rank
can move, :class:`MismatchError` on a wrong pairing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from megatronish.pipeline.ops import DeadlockError

__all__ = [
    "Compute",
    "DeadlockError",
    "MismatchError",
    "P2P",
    "Post",
    "SimReport",
    "Wait",
    "run_groups",
    "run_programs",
]


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


@dataclass(frozen=True)
class Post:
    """A rank posts ``group`` (one ``batch_isend_irecv``) without waiting for it."""

    group: tuple[P2P, ...]


@dataclass(frozen=True)
class Wait:
    """A rank waits until its ``group``-th posted group (0-based) has completed."""

    group: int


@dataclass(frozen=True)
class Compute:
    """A rank computes for ``time`` units."""

    time: float


Event = Post | Wait | Compute
Programs = Mapping[int, Sequence[Event]]


def run_groups(
    groups: Groups,
    compute: Mapping[int, Sequence[float]] | None = None,
    overlap: Mapping[int, Sequence[float]] | None = None,
) -> SimReport:
    """Run every rank's ``groups`` (rank -> groups in posting order) to completion, each group
    waited for before the rank's next compute.

    With ``compute``, rank r computes ``compute[r][i]`` time units after its group i completed
    and then issues group i + 1; with ``overlap`` it also computes ``overlap[r][i]`` right after
    issuing group i, before waiting for it. A transfer completes when both sides have issued it
    (no latency), a group when its last transfer did. That times the bubble of what was posted.
    """
    _check(groups, compute)
    if overlap is not None:
        _check(groups, overlap)
    programs: dict[int, list[Event]] = {}
    for rank, rank_groups in groups.items():
        events: list[Event] = []
        posted = 0
        for i, group in enumerate(rank_groups):
            if group:
                events.append(Post(tuple(group)))
            if overlap is not None:
                events.append(Compute(overlap[rank][i]))
            if group:
                events.append(Wait(posted))
                posted += 1
            if compute is not None:
                events.append(Compute(compute[rank][i]))
        programs[rank] = events
    return run_programs(programs)


def run_programs(programs: Programs) -> SimReport:
    """Run every rank's events (rank -> :class:`Post`, :class:`Wait`, :class:`Compute` in
    order) to completion under NCCL's semantics: a rank's posted groups run one after the other
    (a group's transfers start once the previous group completed: one stream), a send completes
    only with its matched receive, and the rank itself blocks only at a :class:`Wait`. Every
    posted group must complete. Times as :func:`run_groups` (latency-free transfers)."""
    posts = {r: [e.group for e in p if isinstance(e, Post)] for r, p in programs.items()}
    _check(posts, None)
    if any(not group for rank_groups in posts.values() for group in rank_groups):
        raise ValueError("an empty group is never posted: leave its Post out")
    position = dict.fromkeys(programs, 0)  # next event of each rank
    clock = dict.fromkeys(programs, 0.0)
    busy = dict.fromkeys(programs, 0.0)
    posted: dict[int, list[tuple[P2P, ...]]] = {r: [] for r in programs}
    issued_at: dict[int, list[float]] = {r: [] for r in programs}
    completed: dict[int, list[float]] = {r: [] for r in programs}  # completion times, in order
    left = dict.fromkeys(programs, 0)  # unmatched transfers of the running (head) group
    head_at = dict.fromkeys(programs, 0.0)  # when the head group started, later its last match
    done: dict[int, set[int]] = {r: set() for r in programs}  # matched transfers of the head
    sends: dict[tuple[int, int], deque] = {}
    recvs: dict[tuple[int, int], deque] = {}
    matched = 0

    def start_head(rank: int) -> None:
        """Start the rank's oldest uncompleted group if it was posted: its transfers queue."""
        head = len(completed[rank])
        if head == len(posted[rank]):
            return
        group = posted[rank][head]
        at = max([issued_at[rank][head], *completed[rank][-1:]])
        left[rank], head_at[rank] = len(group), at
        done[rank].clear()
        for i, op in enumerate(group):
            pair = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
            queue = sends if op.kind == "send" else recvs
            queue.setdefault(pair, deque()).append((rank, i, op, at))
            match(pair)

    def complete(rank: int, index: int, at: float) -> None:
        done[rank].add(index)
        left[rank] -= 1
        head_at[rank] = max(head_at[rank], at)
        if left[rank] == 0:
            completed[rank].append(head_at[rank])
            start_head(rank)

    def match(pair: tuple[int, int]) -> None:
        nonlocal matched
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

    def advance(rank: int) -> bool:
        events, moved = programs[rank], False
        while position[rank] < len(events):
            event = events[position[rank]]
            if isinstance(event, Post):
                posted[rank].append(event.group)
                issued_at[rank].append(clock[rank])
                if len(posted[rank]) - 1 == len(completed[rank]):
                    start_head(rank)
            elif isinstance(event, Wait):
                if event.group >= len(completed[rank]):
                    return moved
                clock[rank] = max(clock[rank], completed[rank][event.group])
            else:
                clock[rank] += event.time
                busy[rank] += event.time
            position[rank] += 1
            moved = True
        return moved

    while any([advance(rank) for rank in programs]):
        pass
    stuck = [
        r for r in programs if position[r] < len(programs[r]) or len(completed[r]) < len(posted[r])
    ]
    if stuck:
        raise DeadlockError(
            "p2p groups deadlock: "
            + "; ".join(_waiting(r, programs[r], len(completed[r]), done[r]) for r in stuck)
        )
    finish = {r: max([clock[r], *completed[r][-1:]]) for r in programs}
    return SimReport(sum(map(len, posted.values())), matched, finish, busy)


def _waiting(rank: int, events: Sequence[Event], index: int, done: set[int]) -> str:
    groups = [e.group for e in events if isinstance(e, Post)]
    group = groups[index] if index < len(groups) else ()
    ops = ", ".join(f"{op} ({'done' if i in done else 'pending'})" for i, op in enumerate(group))
    return f"rank {rank} waits in group {index} of {len(groups)}: [{ops}]"
