"""Pipeline schedules as pure op lists: 1F1B and interleaved 1F1B, plus an event simulator.

The layer stack is cut into ``pp * vpp`` chunks; global chunk ``c`` lives on pipeline rank
``c % pp`` as that rank's virtual chunk ``c // pp``. Chunk 0 embeds the tokens, the last chunk
computes the loss. vpp = 1 is plain 1F1B (PipeDream-Flush, Narayanan et al. 2021, sec. 2.2.1);
vpp > 1 is Megatron-LM's interleaved 1F1B (same paper, sec. 2.2.2), which divides the bubble by
vpp at the cost of vpp times more point-to-point messages.

Nothing here touches processes or tensors. ``schedule_ops`` places each receive just before and
each send just after its compute; ``simulate`` times that order with sends that never block (the
bubble). A send on NCCL does block until the peer's receive runs: with sends and receives posted
one by one even plain 1F1B deadlocks, rank r sending an activation while rank r+1 sends a
gradient. So the executor posts them in groups, Megatron-LM's batched isend/irecv: which
transfers share a group is :mod:`megatronish.pipeline.grouping`, and
:mod:`megatronish.pipeline.nccl_sim` replays what the executor posts under NCCL's semantics.
Both keep every pair of ranks' messages in ``message_order``.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE_KINDS = ("fwd", "bwd")


@dataclass(frozen=True)
class Op:
    """One step of a rank's schedule.

    ``kind`` is "fwd", "bwd", "recv_act", "send_act", "recv_grad" or "send_grad"; ``chunk`` is the
    GLOBAL chunk id the op belongs to; ``peer`` is the other pipeline rank of a send or receive.
    """

    kind: str
    microbatch: int
    chunk: int
    peer: int | None = None


class DeadlockError(RuntimeError):
    """No rank can make progress: every unfinished rank waits on a message never sent."""


class DependencyError(RuntimeError):
    """A schedule runs an op before the op or message it needs (or names the wrong peer)."""


def _validate(pp: int, vpp: int, num_microbatches: int, rank: int | None = None) -> None:
    if pp < 1:
        raise ValueError(f"pp={pp} must be at least 1.")
    if vpp < 1:
        raise ValueError(f"vpp={vpp} must be at least 1; use vpp=1 for plain 1F1B.")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be at least 1.")
    if vpp > 1 and pp == 1:
        raise ValueError(
            f"vpp={vpp} needs pp > 1 (interleaving one stage gains nothing); set vpp=1."
        )
    if vpp > 1 and num_microbatches % pp != 0:
        raise ValueError(
            f"Interleaved 1F1B needs num_microbatches ({num_microbatches}) divisible by "
            f"pp ({pp}); pick a global batch size giving a multiple of {pp} microbatches."
        )
    if rank is not None and not 0 <= rank < pp:
        raise ValueError(f"rank={rank} must lie in [0, pp={pp}).")


def num_warmup(pp: int, vpp: int, num_microbatches: int, rank: int) -> int:
    """Forwards a rank runs before its first backward.

    1F1B: rank r fills the pipe behind it with ``pp - r - 1`` forwards. Interleaved: every rank
    first runs ``(vpp - 1) * pp`` forwards so its last virtual chunk has work, then twice the
    1F1B count because each downstream hop now costs a forward *and* the backward coming back
    (Megatron-LM ``schedules.py``). Both are capped by the forwards that exist. Older Megatron
    forced all-forward-first when m == pp; newer versions (and we) only cap.
    """
    _validate(pp, vpp, num_microbatches, rank)
    if vpp == 1:
        return min(pp - rank - 1, num_microbatches)
    return min(2 * (pp - rank - 1) + (vpp - 1) * pp, num_microbatches * vpp)


def _virtual_op(pp: int, vpp: int, rank: int, k: int, kind: str) -> Op:
    """The k-th forward (or backward) of a rank, as Megatron's ``get_model_chunk_id`` orders them.

    Microbatches advance in groups of pp: the group visits virtual chunks 0..vpp-1 going forward
    and vpp-1..0 going backward. With vpp = 1 this is simply microbatch k on the rank's chunk.
    """
    step_in_group = (k // pp) % vpp
    virtual = step_in_group if kind == "fwd" else vpp - 1 - step_in_group
    microbatch = (k // (pp * vpp)) * pp + k % pp
    return Op(kind, microbatch, virtual * pp + rank)


def compute_order(pp: int, vpp: int, num_microbatches: int, rank: int) -> list[Op]:
    """The "fwd"/"bwd" ops of ``rank`` in run order: warm-up, steady 1F1B, cool-down."""
    warmup = num_warmup(pp, vpp, num_microbatches, rank)
    total = num_microbatches * vpp
    fwd = lambda k: _virtual_op(pp, vpp, rank, k, "fwd")
    bwd = lambda k: _virtual_op(pp, vpp, rank, k, "bwd")
    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):  # steady state: one forward, then one backward
        order += [fwd(warmup + k), bwd(k)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def schedule_ops(pp: int, vpp: int, num_microbatches: int, rank: int) -> list[Op]:
    """``compute_order`` with each receive just before, and each send just after, its compute."""
    last = pp * vpp - 1
    ops: list[Op] = []
    for op in compute_order(pp, vpp, num_microbatches, rank):
        mb, c = op.microbatch, op.chunk
        if op.kind == "fwd":
            if c > 0:
                ops.append(Op("recv_act", mb, c, peer=(c - 1) % pp))
            ops.append(op)
            if c < last:
                ops.append(Op("send_act", mb, c, peer=(c + 1) % pp))
        else:
            if c < last:
                ops.append(Op("recv_grad", mb, c, peer=(c + 1) % pp))
            ops.append(op)
            if c > 0:
                ops.append(Op("send_grad", mb, c, peer=(c - 1) % pp))
    return ops


def message(op: Op) -> tuple[str, int, int]:
    """The message a send or receive op moves, named by its sender: (kind, microbatch, chunk).

    "act" is the activation out of ``chunk``; "grad" is the gradient w.r.t. the input of ``chunk``.
    """
    if op.kind == "send_act":
        return ("act", op.microbatch, op.chunk)
    if op.kind == "recv_act":
        return ("act", op.microbatch, op.chunk - 1)
    if op.kind == "send_grad":
        return ("grad", op.microbatch, op.chunk)
    if op.kind == "recv_grad":
        return ("grad", op.microbatch, op.chunk + 1)
    raise ValueError(f"Op kind {op.kind!r} moves no message; only send_*/recv_* ops do.")


def message_order(
    pp: int, vpp: int, num_microbatches: int
) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """For every ordered pair (src, dst) of distinct ranks, the messages src sends dst, in order.

    NCCL matches point-to-point calls between two ranks by order, so the receiver must post its
    receives from ``src`` in exactly this order. Pairs that exchange nothing map to ``[]``.
    """
    _validate(pp, vpp, num_microbatches)
    order = {(s, d): [] for s in range(pp) for d in range(pp) if s != d}
    for src in range(pp):
        for op in schedule_ops(pp, vpp, num_microbatches, src):
            if op.kind.startswith("send"):
                order[(src, op.peer)].append(message(op))
    return order


@dataclass
class Simulation:
    """What ``simulate`` measured, per rank (times in the units of fwd_time/bwd_time)."""

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
) -> Simulation:
    """Run all ranks' ``schedule_ops`` together (or the given ``ops``, to test broken schedules).

    A rank runs its ops in order. ``fwd_time``/``bwd_time`` are per chunk op, so with vpp > 1 a
    chunk is 1/vpp of a stage and a step's ideal compute is ``m * vpp * (fwd + bwd)`` per rank.
    Sends never block; a receive waits until its message was sent plus ``comm_time``. Messages
    are matched by (kind, microbatch, chunk) here; NCCL's by-order matching is checked against
    ``message_order`` by the tests. Raises DependencyError if an op runs before what it needs,
    DeadlockError if ranks remain unfinished and none can move.
    """
    _validate(pp, vpp, num_microbatches)
    if ops is None:
        ops = {r: schedule_ops(pp, vpp, num_microbatches, r) for r in range(pp)}
    last = pp * vpp - 1
    sent_at: dict[tuple[str, int, int], float] = {}
    clock = {r: 0.0 for r in range(pp)}
    busy = {r: 0.0 for r in range(pp)}
    timeline: dict[int, list[tuple[Op, float, float]]] = {r: [] for r in range(pp)}
    in_flight = {r: 0 for r in range(pp)}  # forwards whose backward has not run: live activations
    max_in_flight = {r: 0 for r in range(pp)}
    pc = {r: 0 for r in range(pp)}

    def fail(rank: int, op: Op, missing: str) -> DependencyError:
        return DependencyError(f"rank {rank} runs {op} before {missing}.")

    def run(rank: int, op: Op, done: set, received: set) -> bool:
        """Run one op on ``rank``; False if it is a receive whose message was not sent yet."""
        mb, c = op.microbatch, op.chunk
        if op.kind in COMPUTE_KINDS and c % pp != rank:
            raise fail(rank, op, f"noticing chunk {c} lives on rank {c % pp}")
        if op.kind.startswith(("send", "recv")):
            msg = message(op)
            other = msg[2] + 1 if msg[0] == "act" else msg[2] - 1
            sender, receiver = msg[2] % pp, other % pp
            if not 0 <= other <= last or (sender, receiver) != (
                (rank, op.peer) if op.kind.startswith("send") else (op.peer, rank)
            ):
                raise fail(rank, op, f"naming the right peer for message {msg}")
        if op.kind.startswith("recv"):
            if msg not in sent_at:
                return False
            clock[rank] = max(clock[rank], sent_at[msg] + comm_time)
            received.add(msg)
        elif op.kind.startswith("send"):
            needed = ("fwd" if msg[0] == "act" else "bwd", mb, c)
            if needed not in done:
                raise fail(rank, op, f"computing {needed}")
            sent_at[msg] = clock[rank]
        else:
            if op.kind == "fwd" and c > 0 and ("act", mb, c - 1) not in received:
                raise fail(rank, op, f"receiving the activation of chunk {c - 1}")
            if op.kind == "bwd" and ("fwd", mb, c) not in done:
                raise fail(rank, op, "its forward")
            if op.kind == "bwd" and c < last and ("grad", mb, c + 1) not in received:
                raise fail(rank, op, f"receiving the gradient from chunk {c + 1}")
            duration = fwd_time if op.kind == "fwd" else bwd_time
            timeline[rank].append((op, clock[rank], clock[rank] + duration))
            clock[rank] += duration
            busy[rank] += duration
            done.add((op.kind, mb, c))
            in_flight[rank] += 1 if op.kind == "fwd" else -1
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


def analytic_bubble(pp: int, vpp: int, num_microbatches: int) -> float:
    """The paper's bubble fraction ``(pp - 1) / (vpp * m)`` (Narayanan et al. 2021, sec. 2.2)."""
    _validate(pp, vpp, num_microbatches)
    return (pp - 1) / (vpp * num_microbatches)
