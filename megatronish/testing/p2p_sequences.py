"""Posting sequences for the NCCL simulator and for strict-mode replays: the planned groups (and
what the engine posts, waits for and computes with them), Megatron-LM's pairs for interleaved
1F1B (to compare with), and the order the engine used before it batched (kept to show that it
hangs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatronish.pipeline.grouping import OpTimes, Step, _steps, waited_counts
from megatronish.pipeline.nccl_sim import P2P, Compute, Event, Post, Wait
from megatronish.pipeline.ops import Op, message
from megatronish.pipeline.schedule import compute_order, message_order, num_warmup, schedule_ops

Groups = dict[int, list[list[P2P]]]  # pipeline rank -> its groups in posting order
Programs = dict[int, list[Event]]  # pipeline rank -> what it posts, waits for and computes


@dataclass(frozen=True)
class Ran:
    """A compute in a recorded order of posts, waits and computes, by its timeline name
    (``bwd_weight mb0 c1``)."""

    name: str

    @classmethod
    def of(cls, op: Op) -> Ran:
        return cls(f"{op.kind} mb{op.microbatch} c{op.chunk}")


def as_p2p(op: Op, shape: tuple[int, ...]) -> P2P:
    """A send_*/recv_* op as the simulator's entry."""
    return P2P(op.kind[:4], op.peer, message(op), shape)


def planned_groups(
    steps_of: Callable[[int, int, int, int], list[Step]],
    pp: int,
    vpp: int,
    m: int,
    shape: tuple[int, ...],
) -> Groups:
    """The non-empty groups ``steps_of`` (``training_steps`` or ``forward_only_steps``) plans."""
    return {
        rank: [[as_p2p(op, shape) for op in s.group] for s in steps_of(pp, vpp, m, rank) if s.group]
        for rank in range(pp)
    }


def step_program(
    steps: list[Step],
    shape: tuple[int, ...],
    times: OpTimes | None = None,
    weight: Callable[[Op], float] | None = None,
    named: bool = False,
) -> list[Event | Ran]:
    """What the engine does with ``steps``: post each group, run the step's W ops, wait for the
    groups its compute needs (:attr:`Step.ready`) one by one, compute; at the end wait for the
    rest. ``times``: a chunk's F, B and W (a whole backward B + W); None: computes take no time;
    ``weight(op)`` scales an op's time (a heavier chunk). ``named``: every W and compute as its
    :class:`Ran` instead of a timed :class:`Compute` (the order
    :func:`~megatronish.testing.recording_p2p.record_engine` records)."""
    f, b, w = times or (0.0, 0.0, 0.0)
    duration = {"fwd": f, "bwd": b + w, "bwd_input": b}
    scale = weight or (lambda op: 1.0)
    events: list[Event | Ran] = []
    posted = completed = 0
    for step, need in zip(steps, waited_counts(steps), strict=True):
        if step.group:
            events.append(Post(tuple(as_p2p(op, shape) for op in step.group)))
            posted += 1
        if step.weights and named:
            events += [Ran.of(op) for op in step.weights]
        elif step.weights:
            events.append(Compute(sum(w * scale(op) for op in step.weights)))
        events += [Wait(i) for i in range(completed, need)]  # one by one, in posting order
        completed = need
        if step.compute is not None and named:
            events.append(Ran.of(step.compute))
        elif step.compute is not None:
            events.append(Compute(duration[step.compute.kind] * scale(step.compute)))
    return events + [Wait(i) for i in range(completed, posted)]


def planned_programs(
    steps_of: Callable[..., list[Step]],
    pp: int,
    vpp: int,
    m: int,
    shape: tuple[int, ...],
    times: OpTimes | None = None,
    **kw,
) -> Programs:
    """:func:`step_program` of every rank's ``steps_of(pp, vpp, m, rank, **kw)``."""
    return {r: step_program(steps_of(pp, vpp, m, r, **kw), shape, times) for r in range(pp)}


def megatron_pairs(pp: int, vpp: int, m: int, rank: int) -> list[Step]:
    """Interleaved 1F1B as Megatron-LM posts it without overlap (and the engine did before early
    receives): every steady forward+backward pair behind one group, the pair's sends after its
    backward, each compute waiting for its whole group."""
    order = compute_order(pp, vpp, m, rank, "interleaved")
    warmup = num_warmup(pp, vpp, m, rank)
    cooldown_from = len(order) - warmup
    segments = [[op] for op in order[:warmup]]
    segments += [order[i : i + 2] for i in range(warmup, cooldown_from, 2)]
    segments += [[op] for op in order[cooldown_from:]]
    return _steps(pp, vpp, segments, "interleaved", message_order(pp, vpp, m), rank)


def one_op_at_a_time(pp: int, vpp: int, m: int, shape: tuple[int, ...]) -> Groups:
    """The posting order before batching: every send on its own right after its compute, and
    receives posted lazily, each peer's in its send order (as the old ``Inbox`` did)."""
    order = message_order(pp, vpp, m)
    sequences: Groups = {}
    for rank in range(pp):
        posted: set = set()
        groups: list[list[P2P]] = []
        for op in schedule_ops(pp, vpp, m, rank):
            if op.kind.startswith("send"):
                groups.append([as_p2p(op, shape)])
            elif op.kind.startswith("recv") and message(op) not in posted:
                for msg in order[(op.peer, rank)]:
                    if msg not in posted:
                        posted.add(msg)
                        groups.append([P2P("recv", op.peer, msg, shape)])
                    if msg == message(op):
                        break
        sequences[rank] = groups
    return sequences
