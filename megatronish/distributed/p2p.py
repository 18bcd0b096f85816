"""Point-to-point transfers posted as groups (batched isend/irecv): the pipeline's stages and
ring attention's K/V blocks.

A rank's sends and receives between two computes go out as one group: one
``torch.distributed.batch_isend_irecv`` call (NCCL runs it as one ``ncclGroupStart/End``),
waited on as a unit (by the pipeline before the first compute that needs its data, by ring
attention after the block the transfers overlap). Which transfers share a group is decided by
the callers (:mod:`megatronish.pipeline.grouping`, :mod:`megatronish.context_parallel.ring`);
this module only posts them. Shapes are known from the config, so there is no shape handshake.

Both talk to a :class:`P2PCommunicator`, so another one can be substituted: a recording
one (tests replay the groups in :mod:`megatronish.pipeline.nccl_sim`) or a strict one that makes
every send wait for the peer's receive (``megatronish.testing.strict_p2p``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megatronish.distributed.comm import NamedWork, ParallelGroup, named_failures

# ("act" | "grad", microbatch, chunk) between pipeline stages, ("kv" | "dkv", step, owner) in
# ring attention; both ends name a message the same
Message = tuple[str, int, int]
KINDS = ("send", "recv")


@dataclass(frozen=True)
class Transfer:
    """One send or receive of a group.

    ``tensor`` is the data to send or the buffer a receive fills; ``peer`` is the other rank's
    index in the pipeline group; ``message`` names what moves (the receiver names it the same).
    """

    kind: str
    peer: int
    tensor: torch.Tensor
    message: Message

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"transfer kind {self.kind!r} is not one of {KINDS}")


class P2PWork(Protocol):
    """A posted group; ``wait`` returns once every transfer in it has completed."""

    def wait(self) -> None: ...


class P2PCommunicator(Protocol):
    """Posts one group of transfers without waiting for it."""

    def post(self, transfers: Sequence[Transfer]) -> P2PWork: ...


def describe(transfers: Sequence[Transfer], group: ParallelGroup) -> str:
    """``p2p group [send act mb0 c0 to rank 1, recv grad mb0 c1 from rank 1]`` (global ranks)."""
    parts = []
    for t in transfers:
        kind, mb, chunk = t.message
        way = "to" if t.kind == "send" else "from"
        at = f"step {mb} of rank {chunk}'s block" if kind in ("kv", "dkv") else f"mb{mb} c{chunk}"
        parts.append(f"{t.kind} {kind} {at} {way} rank {group.global_rank(t.peer)}")
    return f"p2p group [{', '.join(parts)}]"


class GroupWork:
    """The works of one posted group. It keeps the sent tensors alive until ``wait`` returns,
    so a sender may release its own reference (an output's data) right after posting."""

    def __init__(self, works: Sequence, tensors: Sequence[torch.Tensor]):
        self.works, self.tensors = list(works), list(tensors)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.tensors = [], []


class BatchedP2P:
    """Posts each group with one ``batch_isend_irecv`` on ``group`` and counts its bytes.

    ``CommStats`` gets one ``send`` / ``recv`` entry per transfer, as before batching. A failed
    or timed-out group raises :class:`~megatronish.distributed.comm.CollectiveError` naming
    the group and every transfer in it.
    """

    def __init__(self, group: ParallelGroup):
        self.group = group

    def post(self, transfers: Sequence[Transfer]) -> GroupWork:
        if not transfers:
            return GroupWork([], [])
        pg = self.group.handle()
        name = describe(transfers, self.group)
        ops, tensors = [], []
        for t in transfers:
            tensor = t.tensor.contiguous() if t.kind == "send" else t.tensor
            if t.kind == "recv" and not tensor.is_contiguous():
                raise ValueError(f"receive buffer of {t.message} must be contiguous")
            fn = dist.isend if t.kind == "send" else dist.irecv
            ops.append(dist.P2POp(fn, tensor, self.group.global_rank(t.peer), pg))
            tensors.append(tensor)
            self.group.record(t.kind, tensor)  # CommStats and the log of posted ops
        with named_failures(self.group, name):
            works = dist.batch_isend_irecv(ops)
        return GroupWork([NamedWork(w, self.group, name) for w in works], tensors)
