"""Which pipeline sends and receives are posted together, as Megatron-LM batches them.

On NCCL the point-to-point calls between two ranks run in order, and a send completes only when
the peer's matching receive runs. Posting every send and receive on its own therefore hangs once
messages outgrow NCCL's buffers: with pp=2 and 4 microbatches rank 0 posts [send act0, send
act1, recv grad0] and rank 1 [recv act0, send grad0, recv act1], so both end up with a send at
the head. Each rank therefore posts groups (one ``batch_isend_irecv``), one before each compute,
and waits for them as units, in posting order (one stream: a rank's next group starts only once
the previous one completed, whether or not the rank waited for it):

* Plain 1F1B and ZB-H1 cut a rank's computes into segments of one compute. Before each segment
  there is one group, the sends of the segment before and the receives of this one, and the
  compute waits for it: Megatron's ``send_forward_recv_backward`` and
  ``send_backward_recv_forward`` (``send_forward_recv_forward`` in warm-up). Forward-only
  (evaluation) runs every forward alone, for every schedule but the V.
* Interleaved 1F1B and the V (``zbv``) post early receives, planned by running all ranks
  together in time (:func:`_joint_steps`, torch pipelining's idea): each compute's output leaves
  in the group posted right after it, a group also receives every message its sender has
  produced by the time the rank's next compute starts (in the planned time), and a compute waits
  only for the groups holding its data (:attr:`Step.ready`). A receive is thus in flight while
  the computes before its own run, instead of starting when its compute is due, which on gloo
  costs a round trip per message on the busiest rank, and a send no longer waits for the
  peer's next compute. Megatron-LM without overlap posts
  ``send_forward_backward_recv_forward_backward`` after each steady forward+backward pair of
  interleaved 1F1B instead, so a forward's output leaves only after the pair's backward.

Grouping each compute's sends with only the next compute's receives, each compute waiting for
its own group, hangs interleaved 1F1B: with pp=2, vpp=2, m=4 rank 0 sends grad (0, 2) in a group
of its own, which rank 1 receives only after its group sending grad (1, 3), which rank 0
receives only after that send. Early receives do not: the plan runs the ranks' computes one at
a time in an order that respects every dependency, and a group only receives what a compute
planned before it has produced; the simulator finds no circular wait in any layout the tests
reach. Posting every receive one step ahead, regardless of its send, hangs every schedule: a
receive posted early holds back the rank's later sends. ``tests/pipeline/test_pipeline_nccl_sim.py``
replays what the engine posts and waits for in :mod:`megatronish.pipeline.nccl_sim` for many
layouts.

The zero-bubble schedules post like 1F1B, one segment per forward and per B: a W moves no data,
so it joins no group. It runs after the group before the next compute is posted and before that
group is waited for, filling the time its transfers take (a B's gradient leaves before the W
that follows the B runs). A hand-over between two chunks on the same rank (the turn of the V)
posts nothing.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

from megatronish.config.pipeline_rules import resolve_pipeline_schedule
from megatronish.model.build import stage_of_chunk
from megatronish.pipeline.ops import INPUT_GRAD_KINDS, DeadlockError, Op, message
from megatronish.pipeline.schedule import (
    compute_order,
    message_order,
    transfers_around,
    v_shape,
)


@dataclass(frozen=True)
class Step:
    """One p2p group (sends and receives, possibly none), the W ops that run while it is in
    flight, then one compute op (or None).

    ``ready``: how many of the rank's groups (non-empty ones, counted in posting order from the
    first) must have completed before the compute: the ones holding its data. None: every group
    posted so far, this step's included (the compute waits for its own group)."""

    group: tuple[Op, ...]
    compute: Op | None
    weights: tuple[Op, ...] = ()
    ready: int | None = None


def _recv_of(message: tuple[str, int, int], peer: int) -> Op:
    kind, mb, chunk = message
    return (
        Op("recv_act", mb, chunk + 1, peer)
        if kind == "act"
        else Op("recv_grad", mb, chunk - 1, peer)
    )


class _InOrder:
    """Receives in the order their sender sends them: a receive needed now brings along, into
    the same group, every earlier message from that peer not yet received (NCCL matches a
    pair's transfers by order; the early buffer waits for its compute)."""

    def __init__(self, order: dict[tuple[int, int], list[tuple[str, int, int]]], rank: int):
        self.pending = {src: list(msgs) for (src, dst), msgs in order.items() if dst == rank}

    def expand(self, recvs: list[Op]) -> list[Op]:
        out: list[Op] = []
        for op in recvs:
            queue = self.pending[op.peer]
            if message(op) not in queue:  # brought along earlier
                continue
            upto = queue.index(message(op)) + 1
            out += [_recv_of(msg, op.peer) for msg in queue[:upto]]
            del queue[:upto]
        return out


def _steps(
    pp: int,
    vpp: int,
    segments: list[list[Op]],
    schedule: str,
    order: dict[tuple[int, int], list[tuple[str, int, int]]],
    rank: int,
    weights_before: dict[int, list[Op]] | None = None,
) -> list[Step]:
    """Steps of ``segments``; ``order``: the messages each pair exchanges, in send order;
    ``weights_before[i]``: the W ops the schedule runs just before the i-th compute of the
    segments (``len`` of them: after the last)."""
    weights_before = weights_before or {}
    in_order = _InOrder(order, rank)
    steps: list[Step] = []
    sends: list[Op] = []
    index = 0
    for segment in segments:
        around = [transfers_around(pp, vpp, op, schedule) for op in segment]
        group = tuple(sends + in_order.expand([r for recvs, _ in around for r in recvs]))
        for i, op in enumerate(segment):
            weights = tuple(weights_before.get(index, ()))
            steps.append(Step(group if i == 0 else (), op, weights))
            index += 1
        sends = [s for _, op_sends in around for s in op_sends]
    trailing = tuple(weights_before.get(index, ()))
    if sends or trailing:
        steps.append(Step(tuple(sends), None, trailing))
    return steps


def _split_weights(order: list[Op]) -> tuple[list[Op], dict[int, list[Op]]]:
    """The computes that move data, and the W ops before each (by index; ``len``: after all)."""
    computes: list[Op] = []
    weights_before: dict[int, list[Op]] = {}
    for op in order:
        if op.kind == "bwd_weight":
            weights_before.setdefault(len(computes), []).append(op)
        else:
            computes.append(op)
    return computes, weights_before


OpTimes = tuple[float, float, float]  # relative times of a chunk's F, B and W
EQUAL_TIMES: OpTimes = (1.0, 1.0, 1.0)


def _duration(op: Op, times: OpTimes) -> float:
    """A compute's planned time: F, B, or a whole backward (B + W)."""
    if op.kind == "fwd":
        return times[0]
    return times[1] + (times[2] if op.kind == "bwd" else 0.0)


def _take(
    inbox: list[tuple[Op, float]], op: Op, now: float, transfers: tuple[int, int, str]
) -> list[Op]:
    """The receives to post before ``op``, removed from ``inbox`` (delivered, not yet posted,
    with the time their data exists): the one ``op`` needs, every one whose data exists by
    ``now``, and each peer's earlier ones (pair order; so crossing sends meet their receives in
    the same groups without waiting for later data)."""
    needed, _ = transfers_around(*transfers[:2], op, transfers[2])
    upto: dict[int, int] = {}
    for i, (recv, at) in enumerate(inbox):
        if any(message(recv) == message(n) for n in needed) or at <= now:
            upto[recv.peer] = i
    take = [recv for i, (recv, _) in enumerate(inbox) if i <= upto.get(recv.peer, -1)]
    inbox[:] = [(recv, at) for recv, at in inbox if recv not in take]
    return take


@functools.cache
def _joint_steps(
    pp: int,
    vpp: int,
    num_microbatches: int,
    schedule: str,
    forward_only: bool,
    times: OpTimes = EQUAL_TIMES,
    early: bool = False,
) -> dict[int, tuple[Step, ...]]:
    """Every rank's steps, planned by running all ranks together in time (torch pipelining's
    ``_add_send_recv`` idea, with equal times for F, B and W): the rank whose next compute can
    start first runs it; the receive of each message it sends is delivered to the receiver at
    once, and posted in the receiver's group before the compute that needs it, or earlier
    when a group is posted after the data exists. Sends and receives thus meet in groups posted
    around the same time and every pair's messages keep their send order. Planned with the
    chunk's relative F, B and W ``times``, the groups keep the simulated bubble of the schedule
    at those times.

    ``early``: early receives (training under interleaved 1F1B and the V, whose neighbours
    exchange messages both ways: an activation going up one leg, a gradient coming down the
    other): each compute waits only for the groups holding its data (:attr:`Step.ready`), so a
    receive is in flight while the computes before its own run, as torch pipelining posts them.
    Without it (evaluation of the V) a compute waits for its whole group. A compute is planned
    only once its input exists, so a group only receives what a compute planned before it has
    produced; :func:`~megatronish.pipeline.nccl_sim.run_programs` finds no circular wait among
    the ranks' streams in any layout the tests reach."""
    last = pp * vpp - 1
    v = v_shape(schedule)
    plans = {}
    for r in range(pp):
        order = compute_order(pp, vpp, num_microbatches, r, schedule)
        if forward_only:
            order = [op for op in order if op.kind == "fwd"]
        plans[r] = _split_weights(order)
    position = dict.fromkeys(range(pp), 0)
    clock = dict.fromkeys(range(pp), 0.0)
    inbox: dict[int, list[tuple[Op, float]]] = {r: [] for r in range(pp)}
    sends: dict[int, list[Op]] = {r: [] for r in range(pp)}
    ended: dict[tuple[str, int, int], float] = {}  # computes by (kind, mb, chunk), and messages
    steps: dict[int, list[Step]] = {r: [] for r in range(pp)}
    posted = dict.fromkeys(range(pp), 0)  # non-empty groups each rank has posted
    holder: dict[tuple[str, int, int], int] = {}  # (receiver's) group count holding a message

    def input_time(rank: int, op: Op) -> float | None:
        """When ``op``'s input exists (None: not yet produced)."""
        mb, c = op.microbatch, op.chunk
        if op.kind == "fwd":
            if c == 0:
                return 0.0
            local = stage_of_chunk(c - 1, pp, v) == rank
            return ended.get(("fwd", mb, c - 1) if local else ("act", mb, c - 1))
        if c == last:
            return 0.0
        if stage_of_chunk(c + 1, pp, v) == rank:
            times = [ended.get((kind, mb, c + 1)) for kind in INPUT_GRAD_KINDS]
            return next((t for t in times if t is not None), None)
        return ended.get(("grad", mb, c + 1))

    while any(position[r] < len(plans[r][0]) for r in range(pp)):
        starts = {}
        for r in range(pp):
            computes, weights_before = plans[r]
            if position[r] < len(computes):
                ready = input_time(r, computes[position[r]])
                if ready is not None:
                    weights = len(weights_before.get(position[r], ())) * times[2]
                    starts[r] = max(clock[r] + weights, ready)
        if not starts:
            raise DeadlockError(f"{schedule} with pp={pp}, m={num_microbatches} cannot be posted")
        r = min(starts, key=lambda rank: (starts[rank], rank))
        computes, weights_before = plans[r]
        op = computes[position[r]]
        group = tuple(sends[r] + _take(inbox[r], op, starts[r], (pp, vpp, schedule)))
        ready = None
        if early:
            posted[r] += bool(group)
            holder.update((message(recv), posted[r]) for recv in group if recv.kind[:4] == "recv")
            needed, _ = transfers_around(pp, vpp, op, schedule)
            ready = max((holder[message(recv)] for recv in needed), default=0)
        weights = tuple(weights_before.get(position[r], ()))
        steps[r].append(Step(group, op, weights, ready))
        clock[r] = starts[r] + _duration(op, times)
        ended[(op.kind, op.microbatch, op.chunk)] = clock[r]
        _, sends[r] = transfers_around(pp, vpp, op, schedule)
        for send in sends[r]:
            inbox[send.peer].append((_recv_of(message(send), r), clock[r]))
            ended[message(send)] = clock[r]
        position[r] += 1
    for r in range(pp):
        trailing = tuple(plans[r][1].get(len(plans[r][0]), ()))
        if sends[r] or inbox[r] or trailing:
            steps[r].append(Step(tuple(sends[r] + [op for op, _ in inbox[r]]), None, trailing))
    return {r: tuple(s) for r, s in steps.items()}


def training_steps(
    pp: int,
    vpp: int,
    num_microbatches: int,
    rank: int,
    schedule: str | None = None,
    op_times: OpTimes = EQUAL_TIMES,
) -> list[Step]:
    """One training step on ``rank``: its groups, W ops and computes in order.

    ``op_times``: the relative times of a chunk's F, B and W, which plan the V placement's
    groups (:func:`_joint_steps`); every rank must pass the same numbers (the trainer derives
    them from the model spec, :func:`~megatronish.model.flops.split_backward_times`)."""
    schedule = resolve_pipeline_schedule(schedule, vpp)
    return list(_training_steps(pp, vpp, num_microbatches, rank, schedule, tuple(op_times)))


@functools.cache  # the same for every step of a run; planning them anew cost ~0.2 ms a step
def _training_steps(
    pp: int, vpp: int, num_microbatches: int, rank: int, schedule: str, op_times: OpTimes
) -> tuple[Step, ...]:
    order = compute_order(pp, vpp, num_microbatches, rank, schedule)
    pairs = message_order(pp, vpp, num_microbatches, schedule)
    if v_shape(schedule) or schedule == "interleaved":
        return _joint_steps(pp, vpp, num_microbatches, schedule, False, op_times, True)[rank]
    computes, weights_before = _split_weights(order)  # one segment per forward and per B
    segments = [[op] for op in computes]
    return tuple(_steps(pp, vpp, segments, schedule, pairs, rank, weights_before))


def forward_only_steps(
    pp: int, vpp: int, num_microbatches: int, rank: int, schedule: str | None = None
) -> list[Step]:
    """Evaluation on ``rank``: the schedule's forwards in their order, each its own segment."""
    schedule = resolve_pipeline_schedule(schedule, vpp)
    if v_shape(schedule):
        return list(_joint_steps(pp, vpp, num_microbatches, schedule, True)[rank])
    forwards = [[op] for op in compute_order(pp, vpp, num_microbatches, rank, schedule)]
    forwards = [segment for segment in forwards if segment[0].kind == "fwd"]
    pairs = message_order(pp, vpp, num_microbatches, schedule)
    activations = {pair: [msg for msg in msgs if msg[0] == "act"] for pair, msgs in pairs.items()}
    return _steps(pp, vpp, forwards, schedule, activations, rank)


def waited_counts(steps: list[Step]) -> list[int]:
    """Per step, how many of the rank's groups the executor has waited for (in posting order)
    once the step's compute may start: every group posted so far, or the step's
    :attr:`Step.ready` count (never fewer than before)."""
    counts, posted, completed = [], 0, 0
    for step in steps:
        posted += bool(step.group)
        completed = max(completed, posted if step.ready is None else step.ready)
        counts.append(completed)
    return counts


def run_order(steps: list[Step]) -> list[Op]:
    """Every op of ``steps`` in the order in time of the executor's timeline events: a group's
    sends when it is posted if it also receives (else when it is waited for), its receives when
    it is waited for (in posting order, before the first compute that needs it:
    :attr:`Step.ready`), the step's W ops between posting and waiting, then its compute."""
    out: list[Op] = []
    in_flight: deque[tuple[list[Op], list[Op]]] = deque()
    completed = 0
    for step, need in zip(steps, waited_counts(steps), strict=True):
        sends = [op for op in step.group if op.kind.startswith("send")]
        recvs = [op for op in step.group if op.kind.startswith("recv")]
        if step.group:
            in_flight.append((sends, recvs))
        if sends and recvs:
            out += sends
        out += step.weights
        while completed < need:
            group_sends, group_recvs = in_flight.popleft()
            out += group_recvs or group_sends
            completed += 1
        out += [step.compute] if step.compute else []
    return out + [op for group_sends, group_recvs in in_flight for op in group_recvs or group_sends]
