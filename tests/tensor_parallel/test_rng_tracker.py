"""RNG tracker: per-tp-rank dropout inside tp regions, identical outside, reproducible."""

import torch
import torch.nn.functional as F

from megatronish.distributed.comm import all_gather_dim0
from megatronish.distributed.topology import Topology
from megatronish.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatronish.tensor_parallel.random import RNGTracker
from megatronish.testing.multiproc import run_world


def _masks(rank, world):
    topo = Topology.build(tp=world, dp=1, pp=1, rank=rank)
    rng = RNGTracker(torch.device("cpu"))
    rng.seed(42, tp_rank=topo.coords.tp)
    outside = F.dropout(torch.ones(64), 0.5)
    with rng.fork("tp"):
        inside = F.dropout(torch.ones(64), 0.5)
    gathered = all_gather_dim0(torch.stack([outside, inside]).unsqueeze(0), topo.tp_group)
    return gathered


def test_masks_differ_inside_tp_regions_and_agree_outside():
    g = run_world(_masks, 2)[0]
    assert torch.equal(g[0, 0], g[1, 0])  # replicated activations: same mask on every tp rank
    assert not torch.equal(g[0, 1], g[1, 1])  # tp region: each rank its own mask


def _dropout_layer(rank, world):
    topo = Topology.build(tp=world, dp=1, pp=1, rank=rank)
    g = topo.tp_group
    rng = RNGTracker(torch.device("cpu"))
    rng.seed(3, tp_rank=topo.coords.tp)
    gen = torch.Generator().manual_seed(0)
    w1, w2, x = (
        torch.randn(16, 8, generator=gen),
        torch.randn(8, 16, generator=gen),
        torch.randn(4, 2, 8, generator=gen),
    )
    col, row = ColumnParallelLinear(8, 16, g), RowParallelLinear(16, 8, g)
    n = 16 // g.size
    with torch.no_grad():
        col.weight.copy_(w1[g.rank * n : (g.rank + 1) * n])
        row.weight.copy_(w2[:, g.rank * n : (g.rank + 1) * n])
    y = col(x)
    with rng.fork("tp"):
        mask = F.dropout(torch.ones_like(y), 0.3)
    z = row(y * mask)
    full_mask = torch.cat(all_gather_dim0(mask.unsqueeze(0), g).unbind(0), dim=-1)
    reference = F.linear(F.linear(x, w1) * full_mask, w2)  # one process, the same masks
    torch.testing.assert_close(z, reference)
    return True


def test_tp2_dropout_matches_serial_with_the_same_masks():
    assert all(run_world(_dropout_layer, 2))


def test_saved_states_reproduce_the_same_masks():
    rng = RNGTracker(torch.device("cpu"))
    rng.seed(5, tp_rank=1)
    state = rng.state_dict()
    with rng.fork("tp"):
        first = F.dropout(torch.ones(32), 0.5)
    plain_first = F.dropout(torch.ones(32), 0.5)
    rng.load_state_dict(state)
    with rng.fork("tp"):
        again = F.dropout(torch.ones(32), 0.5)
    assert torch.equal(first, again)
    assert torch.equal(plain_first, F.dropout(torch.ones(32), 0.5))


def _cp_masks(rank, world):
    """tp=2 x cp=2: masks of replicated (outside) and tp-region (inside) activations."""
    topo = Topology.build(tp=2, dp=1, pp=1, rank=rank, cp=2)
    rng = RNGTracker(torch.device("cpu"))
    rng.seed(42, tp_rank=topo.coords.tp, cp_rank=topo.coords.cp)
    outside = F.dropout(torch.ones(64), 0.5)
    with rng.fork("tp"):
        inside = F.dropout(torch.ones(64), 0.5)
    return topo.coords, outside, inside


def test_cp_ranks_draw_their_own_masks():
    """cp ranks hold other tokens of the same samples: their masks must differ, while the tp
    ranks of one cp rank (which hold the same tokens without sp) share the replicated mask."""
    got = {(c.tp, c.cp): (outside, inside) for c, outside, inside in run_world(_cp_masks, 4)}
    for cp in (0, 1):
        assert torch.equal(got[(0, cp)][0], got[(1, cp)][0])
        assert not torch.equal(got[(0, cp)][1], got[(1, cp)][1])
    for tp in (0, 1):
        assert not torch.equal(got[(tp, 0)][0], got[(tp, 1)][0])
        assert not torch.equal(got[(tp, 0)][1], got[(tp, 1)][1])
    insides = [inside for _, inside in got.values()]
    assert all(not torch.equal(a, b) for i, a in enumerate(insides) for b in insides[i + 1 :])
