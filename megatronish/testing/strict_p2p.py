"""A p2p communicator for CPU tests with NCCL's ordering: a send completes only once the peer's
matching receive ran, and a rank's groups run one after the other.

On gloo, posting a send never blocks and its wait returns once the peer has posted the matching
receive; nothing orders one group after the previous. Code that posts sends without waiting for
them (as the engine once did) therefore runs on CPU in an order that hangs on NCCL, where the
point-to-point calls of a rank run in order on one stream. :class:`StrictP2P` posts each group as
:class:`~megatronish.distributed.p2p.BatchedP2P` does, but only after the previous group completed
(waiting for it if the caller has not), and for every send it posts a receive of an
acknowledgement (tag :data:`ACK_TAG`) that the peer sends once its matching receive has
completed. Waiting for a group returns only when every send in it was acknowledged. The
acknowledgement names the message the receiver expected; the sender checks it against what it
sent, so a pairing that would swap tensors fails instead of passing silently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatronish.distributed.comm import CollectiveError, ParallelGroup, named_failures
from megatronish.distributed.p2p import BatchedP2P, GroupWork, Message, Transfer, describe

ACK_TAG = 7
_KINDS = ("act", "grad", "kv", "dkv")  # pipeline messages, ring attention's


def _encode(message: Message) -> torch.Tensor:
    kind, mb, chunk = message
    return torch.tensor([_KINDS.index(kind), mb, chunk], dtype=torch.int64)


def _decode(t: torch.Tensor) -> Message:
    kind, mb, chunk = t.tolist()
    return (_KINDS[kind], mb, chunk)


class StrictWork:
    """A posted group whose ``wait`` also acknowledges its receives and awaits its sends' acks."""

    def __init__(
        self,
        group: ParallelGroup,
        data: GroupWork,
        transfers: Sequence[Transfer],
        acks: list[tuple[Transfer, torch.Tensor, object]],
    ):
        self.group, self.data, self.transfers, self.acks = group, data, transfers, acks
        self.completed = False

    def _op(self, what: str) -> str:
        return f"{describe(self.transfers, self.group)} ({what})"

    def wait(self) -> None:
        if self.completed:
            return
        if len(self.data.works) != len(self.transfers):  # gloo: one work per transfer
            raise RuntimeError("StrictP2P needs one work per transfer (the gloo backend)")
        works = dict(zip(map(id, self.transfers), self.data.works, strict=True))
        replies = []
        for t in self.transfers:  # each receive is acknowledged as soon as it completed
            if t.kind == "recv":
                works[id(t)].wait()
                peer = self.group.global_rank(t.peer)
                ack = _encode(t.message)
                with named_failures(self.group, self._op(f"acknowledging to rank {peer}")):
                    work = dist.isend(ack, dst=peer, group=self.group.handle(), tag=ACK_TAG)
                replies.append((work, ack, peer))
        for t, buf, ack_work in self.acks:
            works[id(t)].wait()
            peer = self.group.global_rank(t.peer)
            kind, mb, chunk = t.message
            with named_failures(
                self.group, self._op(f"rank {peer} has not received {kind} mb{mb} c{chunk}")
            ):
                ack_work.wait()
            if _decode(buf) != t.message:
                raise CollectiveError(
                    f"{self._op('strict check')}: rank {peer} received "
                    f"{t.message} as {_decode(buf)}"
                )
        for work, _, peer in replies:
            with named_failures(self.group, self._op(f"acknowledging to rank {peer}")):
                work.wait()
        self.data = GroupWork([], [])  # every work was waited once (gloo counts waits); release
        self.completed = True


class StrictP2P:
    """:class:`~megatronish.distributed.p2p.BatchedP2P` with NCCL's ordering: a group starts when
    the previous one completed, and a send completes when the peer's receive has run."""

    def __init__(self, group: ParallelGroup):
        self.group = group
        self.data = BatchedP2P(group)
        self.previous: StrictWork | None = None

    def post(self, transfers: Sequence[Transfer]) -> StrictWork:
        if self.previous is not None:
            self.previous.wait()  # one stream: this group runs after the last one completed
        data = self.data.post(transfers)
        acks = []
        for t in transfers:
            if t.kind == "send":
                buf = torch.empty(3, dtype=torch.int64)
                with named_failures(self.group, describe(transfers, self.group)):
                    work = dist.irecv(
                        buf,
                        src=self.group.global_rank(t.peer),
                        group=self.group.handle(),
                        tag=ACK_TAG,
                    )
                acks.append((t, buf, work))
        self.previous = StrictWork(self.group, data, transfers, acks)
        return self.previous
