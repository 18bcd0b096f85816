"""An event simulator of pipeline schedules: dependencies, in-flight activations and the bubble.

:func:`simulate` runs every rank's :func:`~megatronish.pipeline.schedule.schedule_ops` (or given
ops) together with per-op times, sends that never block and receives that wait for their
message; it raises when a schedule runs an op before what it needs or deadlocks.
:func:`analytic_bubble` is each schedule's bubble in closed form, which the tests hold the
simulation to.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.model.build import stage_of_chunk
from megatronish.pipeline.ops import DeadlockError, DependencyError, Op, message
from megatronish.pipeline.schedule import check_schedule, schedule_ops, v_shape


@dataclass
class Simulation:
    """What ``simulate`` measured, per rank (times in the units of fwd_time/bwd_time).

    ``max_in_flight``: the most microbatch-chunks whose forward ran and whose backward (its W,
    in the zero-bubble schedules) had not: the activations a rank holds at its peak.
    """

    finish_time: dict[int, float]
    busy_time: dict[int, float]
    timeline: dict[int, list[tuple[Op, float, float]]]
    max_in_flight: dict[int, int]


def simulate(
    pp: int,
    vpp: int,
    num_microbatches: int,
    fwd_time: float = 1.0,
    bwd_time: float = 2.0,
    comm_time: float = 0.0,
    *,
    ops: dict[int, list[Op]] | None = None,
    schedule: str | None = None,
    weight_time: float | None = None,
) -> Simulation:
    """Run all ranks' ``schedule_ops`` together (or the given ``ops``, to test broken schedules).

    A rank runs its ops in order. ``fwd_time``/``bwd_time`` are per chunk op, so with vpp > 1 a
    chunk is 1/vpp of a stage and a step's ideal compute is ``m * vpp * (fwd + bwd)`` per rank.
    A split backward takes ``bwd_time - weight_time`` for B and ``weight_time`` for W
    (``weight_time`` defaults to half the backward). Sends never block; a receive waits until its
    message was sent plus ``comm_time``; a neighbour chunk on the same rank hands over at once.
    Messages are matched by (kind, microbatch, chunk) here; NCCL's by-order matching is checked
    against ``message_order`` by the tests. Raises DependencyError if an op runs before what it
    needs, DeadlockError if ranks remain unfinished and none can move.
    """
    schedule = check_schedule(pp, vpp, num_microbatches, schedule=schedule)
    v = v_shape(schedule)
    if ops is None:
        ops = {r: schedule_ops(pp, vpp, num_microbatches, r, schedule) for r in range(pp)}
    w_time = bwd_time / 2 if weight_time is None else weight_time
    duration = {
        "fwd": fwd_time,
        "bwd": bwd_time,
        "bwd_input": bwd_time - w_time,
        "bwd_weight": w_time,
    }
    last = pp * vpp - 1
    sent_at: dict[tuple[str, int, int], float] = {}
    clock = {r: 0.0 for r in range(pp)}
    busy = {r: 0.0 for r in range(pp)}
    timeline: dict[int, list[tuple[Op, float, float]]] = {r: [] for r in range(pp)}
    in_flight = {r: 0 for r in range(pp)}  # forwards whose backward has not run: live activations
    max_in_flight = {r: 0 for r in range(pp)}
    pc = {r: 0 for r in range(pp)}
    # When each compute (kind, microbatch, chunk) ended, across ranks: a local hand-over needs it.
    ended: dict[tuple[str, int, int], float] = {}

    def fail(rank: int, op: Op, missing: str) -> DependencyError:
        return DependencyError(f"rank {rank} runs {op} before {missing}.")

    def input_grad_done(mb: int, c: int) -> float | None:
        return ended.get(("bwd", mb, c), ended.get(("bwd_input", mb, c)))

    def needs(rank: int, op: Op, done: set, received: set) -> None:
        """Raise unless what compute ``op`` needs on ``rank`` has run or arrived."""
        mb, c = op.microbatch, op.chunk
        if op.kind == "fwd" and c > 0:
            local = stage_of_chunk(c - 1, pp, v) == rank
            if (("fwd", mb, c - 1) not in done) if local else ("act", mb, c - 1) not in received:
                raise fail(rank, op, f"receiving the activation of chunk {c - 1}")
        if op.kind in ("bwd", "bwd_input"):
            if ("fwd", mb, c) not in done:
                raise fail(rank, op, "its forward")
            if c < last:
                local = stage_of_chunk(c + 1, pp, v) == rank
                arrived = (
                    input_grad_done(mb, c + 1) is not None
                    if local
                    else ("grad", mb, c + 1) in received
                )
                if not arrived:
                    raise fail(rank, op, f"receiving the gradient from chunk {c + 1}")
        if op.kind == "bwd_weight" and ("bwd_input", mb, c) not in done:
            raise fail(rank, op, "its B (bwd_input)")

    def run(rank: int, op: Op, done: set, received: set) -> bool:
        """Run one op on ``rank``; False if it is a receive whose message was not sent yet."""
        mb, c = op.microbatch, op.chunk
        if op.kind in duration and stage_of_chunk(c, pp, v) != rank:
            raise fail(rank, op, f"noticing chunk {c} lives on rank {stage_of_chunk(c, pp, v)}")
        if op.kind.startswith(("send", "recv")):
            msg = message(op)
            other = msg[2] + 1 if msg[0] == "act" else msg[2] - 1
            if not 0 <= other <= last or (
                stage_of_chunk(msg[2], pp, v),
                stage_of_chunk(other, pp, v),
            ) != ((rank, op.peer) if op.kind.startswith("send") else (op.peer, rank)):
                raise fail(rank, op, f"naming the right peer for message {msg}")
        if op.kind.startswith("recv"):
            if msg not in sent_at:
                return False
            clock[rank] = max(clock[rank], sent_at[msg] + comm_time)
            received.add(msg)
            return True
        if op.kind.startswith("send"):
            needed = ("fwd",) if msg[0] == "act" else ("bwd", "bwd_input")
            if not any((kind, mb, c) in done for kind in needed):
                raise fail(rank, op, f"computing {needed[0]} of microbatch {mb}, chunk {c}")
            sent_at[msg] = clock[rank]
            return True
        needs(rank, op, done, received)
        if op.kind == "fwd" and c > 0 and stage_of_chunk(c - 1, pp, v) == rank:
            clock[rank] = max(clock[rank], ended[("fwd", mb, c - 1)])
        if op.kind in ("bwd", "bwd_input") and c < last and stage_of_chunk(c + 1, pp, v) == rank:
            clock[rank] = max(clock[rank], input_grad_done(mb, c + 1))
        start = clock[rank]
        clock[rank] += duration[op.kind]
        timeline[rank].append((op, start, clock[rank]))
        busy[rank] += duration[op.kind]
        done.add((op.kind, mb, c))
        ended[(op.kind, mb, c)] = clock[rank]
        if op.kind == "fwd":
            in_flight[rank] += 1
        elif op.kind in ("bwd", "bwd_weight"):
            in_flight[rank] -= 1
        max_in_flight[rank] = max(max_in_flight[rank], in_flight[rank])
        return True

    done = {r: set() for r in range(pp)}
    received = {r: set() for r in range(pp)}
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pc[r] < len(ops[r]) and run(r, ops[r][pc[r]], done[r], received[r]):
                pc[r] += 1
                progress = True
    stuck = {r: ops[r][pc[r]] for r in range(pp) if pc[r] < len(ops[r])}
    if stuck:
        waits = "; ".join(f"rank {r} waits on {op}" for r, op in stuck.items())
        raise DeadlockError(f"Pipeline schedule deadlocks: {waits}.")
    return Simulation(dict(clock), busy, timeline, max_in_flight)


def bubble_fraction(sim: Simulation, rank: int) -> float:
    """Idle time of ``rank`` over its busy time, up to the step's makespan.

    The step ends when the slowest rank finishes (the optimizer waits for all of them), so
    ``(max finish - busy) / busy``: the quantity Narayanan et al. call the bubble fraction.
    """
    makespan = max(sim.finish_time.values())
    return (makespan - sim.busy_time[rank]) / sim.busy_time[rank]


def analytic_bubble(
    pp: int,
    vpp: int,
    num_microbatches: int,
    schedule: str | None = None,
    fwd_time: float = 1.0,
    bwd_time: float = 2.0,
    weight_time: float | None = None,
) -> float:
    """Each schedule's bubble fraction in closed form (idle time over busy time, per rank).

    ``fwd_time``, ``bwd_time`` and ``weight_time`` are per chunk op (f, b + w and w). The idle
    time per rank: 1F1B ``(pp - 1)(f + b + w)``, interleaved 1F1B the same over vpp (Narayanan
    et al. 2021, sec. 2.2: fractions ``(pp - 1) / m`` and ``(pp - 1) / (vpp m)``); ZB-H1
    ``(pp - 1)(f + b - w)`` (Qi et al. 2023, sec. 3.1), exact while ``w <= f`` and ``w <= b``;
    ZBV ``(pp - 1)(f + b - w)`` per chunk op, exact in the balanced case ``f = b = w`` the
    schedule is built for, where it is ``(pp - 1) f``: only the pipeline's fill, which no schedule
    avoids (the last rank cannot start before the first microbatch crossed the others; the
    paper's ``(pp - 1)(F + B - 2W)`` leaves the fill out). With unbalanced times the static ZBV
    order loses more or less than that, and :func:`simulate` is the reference. Zero-bubble
    values need ``m >= pp`` (ZB-H1) and ``m >= 2 pp`` (ZBV) microbatches.
    """
    schedule = check_schedule(pp, vpp, num_microbatches, schedule=schedule)
    w = bwd_time / 2 if weight_time is None else weight_time
    f, b = fwd_time, bwd_time - w
    busy = num_microbatches * vpp * (f + b + w)
    if schedule in ("zb-h1", "zbv"):
        return (pp - 1) * max(f + b - w, 0.0) / busy
    return (pp - 1) / (vpp * num_microbatches)
