"""Posting sequences for the NCCL simulator and for strict-mode replays: the planned groups, and
the order the engine used before it batched (kept to show that it hangs)."""

from __future__ import annotations

from collections.abc import Callable

from megatronish.pipeline.grouping import Step
from megatronish.pipeline.nccl_sim import P2P
from megatronish.pipeline.ops import Op, message
from megatronish.pipeline.schedule import message_order, schedule_ops

Groups = dict[int, list[list[P2P]]]  # pipeline rank -> its groups in posting order


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
