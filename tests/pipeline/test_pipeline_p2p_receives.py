"""A batched p2p group on gloo can be waited for by its receives alone: its sends then complete
in the background (the engine does not stall its next compute on the peer's receive), and the
group poster waits for them at the end of the step."""

import torch
import torch.distributed as dist

from megatronish.distributed.topology import Topology
from megatronish.pipeline.ops import Op
from megatronish.pipeline.p2p import BatchedP2P, Transfer
from megatronish.pipeline.posting import GroupPoster
from megatronish.testing.multiproc import run_world

SHAPE = (4, 2, 8)
RELEASE_TAG = 9  # rank 0 tells rank 1 it may receive rank 0's send


def _receives_first(rank, world, through_poster):
    """Rank 1 sends its message, then receives rank 0's only after rank 0's receive returned:
    rank 0 hangs if waiting for its group's receives also waits for the group's send."""
    topo = Topology.build(tp=1, dp=1, pp=world, rank=rank, timeout_s=30.0)
    comm = BatchedP2P(topo.pp_group)
    peer, flag = 1 - rank, torch.zeros(1)
    if rank == 1:
        mine = torch.full(SHAPE, 2.0)
        comm.post([Transfer("send", peer, mine, ("act", 0, 1))]).wait()
        dist.recv(flag, src=peer, tag=RELEASE_TAG)
        theirs = torch.zeros(SHAPE)
        comm.post([Transfer("recv", peer, theirs, ("grad", 0, 2))]).wait()
        return theirs.flatten()[0].item()
    got = torch.zeros(SHAPE)
    ops = [Op("send_grad", 0, 2, peer), Op("recv_act", 0, 2, peer)]
    tensors = [torch.full(SHAPE, 1.0), got]
    if through_poster:
        poster = GroupPoster(comm)
        poster.wait(poster.post(ops, tensors))  # returns with the send still in flight
        dist.send(flag, dst=peer, tag=RELEASE_TAG)
        poster.finish()
    else:
        transfers = [Transfer("send", peer, tensors[0], ("grad", 0, 2))]
        work = comm.post([*transfers, Transfer("recv", peer, got, ("act", 0, 1))])
        work.wait_receives()
        dist.send(flag, dst=peer, tag=RELEASE_TAG)
        work.wait()
    return got.flatten()[0].item()


def test_group_work_waits_for_its_receives_alone():
    assert run_world(_receives_first, 2, False, timeout=60) == [2.0, 1.0]


def test_group_poster_leaves_sends_in_flight_until_finish():
    assert run_world(_receives_first, 2, True, timeout=60) == [2.0, 1.0]
