"""The steps of a pipeline schedule (:class:`Op`), the messages they move and the errors a
schedule can have.

Compute kinds: ``fwd``; ``bwd`` (a whole backward: 1F1B and interleaved 1F1B); and, for the
zero-bubble schedules, ``bwd_input`` (B: the gradient w.r.t. the chunk's input, which the
previous chunk waits for) and ``bwd_weight`` (W: the chunk's weight gradients, which nobody waits
for). Transfers: ``recv_act``, ``send_act``, ``recv_grad``, ``send_grad``.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE_KINDS = ("fwd", "bwd", "bwd_input", "bwd_weight")
# The backward kinds that produce the input gradient (and send it to the previous chunk).
INPUT_GRAD_KINDS = ("bwd", "bwd_input")


@dataclass(frozen=True)
class Op:
    """One step of a rank's schedule.

    ``kind`` is a compute kind (:data:`COMPUTE_KINDS`) or "recv_act", "send_act", "recv_grad",
    "send_grad"; ``chunk`` is the GLOBAL chunk id the op belongs to; ``peer`` is the other
    pipeline rank of a send or receive.
    """

    kind: str
    microbatch: int
    chunk: int
    peer: int | None = None


class DeadlockError(RuntimeError):
    """No rank can make progress: every unfinished rank waits on a message never sent."""


class DependencyError(RuntimeError):
    """A schedule runs an op before the op or message it needs (or names the wrong peer)."""


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
