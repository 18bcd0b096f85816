"""Record what the pipeline engine posts, for :mod:`megatronish.pipeline.nccl_sim`.

:class:`RecordingP2P` needs no process group: it notes every group and fills receives with
zeros, so one process runs every rank's real engine in turn (:func:`record_engine`), on
:func:`stub_chunks` (a few scalar weights each) or on real model chunks. :class:`NotingTimeline`
also notes where each compute begins among the posts and waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from megatronish.distributed.comm import CommStats, ParallelGroup
from megatronish.distributed.p2p import Transfer
from megatronish.distributed.parallel_grid import ParallelGrid
from megatronish.distributed.topology import Topology
from megatronish.model.build import chunk_ids_of_stage
from megatronish.pipeline.engine import (
    PipelineShape,
    Timeline,
    attach_split_backward,
    forward_backward_pipeline,
    forward_only_pipeline,
)
from megatronish.pipeline.nccl_sim import P2P, Event, Post, Wait
from megatronish.tensor_parallel.weight_grad import WeightGradStore
from megatronish.testing.p2p_sequences import Ran

Groups = dict[int, list[list[P2P]]]  # pipeline rank -> the groups it posted, in order
Programs = dict[int, list[Event | Ran]]  # pipeline rank -> its posts and waits (and computes)


class _Recorded:
    """A posted group whose ``wait`` is noted in the communicator's program."""

    def __init__(self, program: list[Event], index: int):
        self.program, self.index = program, index

    def wait(self) -> None:
        self.program.append(Wait(self.index))


class RecordingP2P:
    """A communicator that records each group as :class:`P2P` entries and receives zeros;
    ``program`` also notes when each group is waited for (:class:`Post` and :class:`Wait`)."""

    def __init__(self):
        self.groups: list[list[P2P]] = []
        self.program: list[Event] = []

    def post(self, transfers: Sequence[Transfer]) -> _Recorded:
        group = [P2P(t.kind, t.peer, t.message, tuple(t.tensor.shape)) for t in transfers]
        self.groups.append(group)
        self.program.append(Post(tuple(group)))
        for t in transfers:
            if t.kind == "recv":
                t.tensor.zero_()
        return _Recorded(self.program, len(self.groups) - 1)


class NotingTimeline(Timeline):
    """A timeline that also appends a :class:`Ran` to ``program`` as each op's span begins, so
    the program holds the engine's posts, waits and computes in the order it ran them."""

    def __init__(self, program: list[Event | Ran]):
        super().__init__()
        self.program = program

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        self.program.append(Ran(name))
        with super().span(name):
            yield


class StubChunk(nn.Module):
    """One scalar weight per layer, multiplied in: the first chunk ignores its tokens and starts
    from ones of ``shape``; the last returns a scalar loss."""

    def __init__(self, shape: tuple[int, ...], layers: int, first: bool, last: bool):
        super().__init__()
        self.shape, self.first, self.last = shape, first, last
        self.weights = nn.Parameter(torch.ones(layers))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            x = torch.ones(self.shape)
        x = x * self.weights.prod()
        return x.sum() if self.last else x


def stub_chunks(
    pp: int,
    vpp: int,
    rank: int,
    split: Sequence[int],
    shape: tuple[int, ...],
    v_shape: bool = False,
) -> list[nn.Module]:
    """The stub chunks of pipeline ``rank``; ``split`` gives the layers of every global chunk
    (``v_shape``: the V placement of the zbv schedule)."""
    last = pp * vpp - 1
    return [
        StubChunk(shape, split[c], c == 0, c == last)
        for c in chunk_ids_of_stage(rank, pp, vpp, v_shape)
    ]


def stub_topology(pp: int, rank: int) -> Topology:
    """A one-process Topology in which this process plays pipeline ``rank`` (no process group)."""
    group = ParallelGroup(name="pp", ranks=tuple(range(pp)), rank=rank)
    return Topology(
        rank=rank,
        grid=ParallelGrid.of(pp=pp),
        groups={"pp": group},
        device=torch.device("cpu"),
        stats=CommStats(),
    )


def record_engine(
    pp: int,
    vpp: int,
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
    chunks_of: Callable[[int], list[nn.Module]],
    shape: PipelineShape,
    forward_only: bool = False,
    schedule: str | None = None,
    programs: bool = False,
    computes: bool = False,
) -> Groups | Programs:
    """Run the engine once per pipeline rank (``chunks_of(rank)``); the groups each posted
    (``programs``: its posts and waits, for :func:`~megatronish.pipeline.nccl_sim.run_programs`;
    ``computes``: with a :class:`Ran` where each training compute began, F, B and W)."""
    groups: dict = {}
    for rank in range(pp):
        comm = RecordingP2P()
        topo = stub_topology(pp, rank)
        chunks = chunks_of(rank)
        if forward_only:
            forward_only_pipeline(
                chunks,
                microbatches,
                topo=topo,
                vpp=vpp,
                shape=shape,
                comm=comm,
                schedule=schedule,
            )
        else:
            store = WeightGradStore()
            attach_split_backward(chunks, store)
            timeline = NotingTimeline(comm.program) if computes else None
            forward_backward_pipeline(
                chunks,
                microbatches,
                loss_scale=1.0,
                topo=topo,
                vpp=vpp,
                shape=shape,
                comm=comm,
                schedule=schedule,
                weight_grads=store,
                timeline=timeline,
            )
        groups[rank] = comm.program if programs else comm.groups
    return groups
