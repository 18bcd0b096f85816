"""Each tensor-parallel layer against its plain torch counterpart, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from megatronish.distributed.topology import Topology
from megatronish.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatronish.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatronish.tensor_parallel.mappings import (
    gather_from_sp,
    gather_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
)
from megatronish.testing.multiproc import run_world

S, B, H, OUT = 8, 3, 12, 16


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def seq_shard(x, g):
    n = x.shape[0] // g.size
    return x[g.rank * n : (g.rank + 1) * n]


def _column(rank, world, sp, blocks):
    g = Topology.build(tp=world, dp=1, pp=1, rank=rank).tp_group
    w, x, dy = rand(OUT, H, seed=1), rand(S, B, H, seed=2), rand(S, B, OUT, seed=3)
    x.requires_grad_(True)
    w_ref = w.clone().requires_grad_(True)
    y_ref = F.linear(x, w_ref)
    y_ref.backward(dy)

    layer = ColumnParallelLinear(H, OUT, g, sequence_parallel=sp, blocks=blocks)
    shard = layer.weight.info.shard
    with torch.no_grad():
        layer.weight.copy_(shard.take(w, g.rank, g.size))
    x_in = (seq_shard(x, g) if sp else x).detach().requires_grad_(True)
    y = layer(x_in)
    y.backward(shard.take(dy, g.rank, g.size) if False else _take_last(dy, shard, g))
    torch.testing.assert_close(y, _take_last(y_ref.detach(), shard, g))
    torch.testing.assert_close(layer.weight.grad, shard.take(w_ref.grad, g.rank, g.size))
    expect_dx = seq_shard(x.grad, g) if sp else x.grad
    torch.testing.assert_close(x_in.grad, expect_dx)
    return True


def _take_last(t, shard, g):
    parts = [t.narrow(-1, s, n) for s, n in shard.ranges(g.rank, g.size)]
    return torch.cat(parts, dim=-1)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("blocks", [None, (8, 4, 4)])
def test_column_parallel_linear_matches_linear(sp, blocks):
    assert all(run_world(_column, 2, sp, blocks))


def _row(rank, world, sp, bias):
    g = Topology.build(tp=world, dp=1, pp=1, rank=rank).tp_group
    w, b = rand(OUT, H, seed=4), rand(OUT, seed=5)
    x, dy = rand(S, B, H, seed=6).requires_grad_(True), rand(S, B, OUT, seed=7)
    w_ref, b_ref = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    y_ref = F.linear(x, w_ref, b_ref if bias else None)
    y_ref.backward(dy)

    layer = RowParallelLinear(H, OUT, g, bias=bias, sequence_parallel=sp)
    n = H // g.size
    with torch.no_grad():
        layer.weight.copy_(w[:, g.rank * n : (g.rank + 1) * n])
        if bias:
            layer.bias.copy_(b)
    x_in = x.detach()[..., g.rank * n : (g.rank + 1) * n].clone().requires_grad_(True)
    y = layer(x_in)
    y.backward(seq_shard(dy, g) if sp else dy)
    torch.testing.assert_close(y, seq_shard(y_ref.detach(), g) if sp else y_ref.detach())
    torch.testing.assert_close(layer.weight.grad, w_ref.grad[:, g.rank * n : (g.rank + 1) * n])
    torch.testing.assert_close(x_in.grad, x.grad[..., g.rank * n : (g.rank + 1) * n])
    if bias:  # under sp each rank sees its shard's part; the trainer sums them over tp
        part = layer.bias.grad.clone()
        if sp:
            torch.distributed.all_reduce(part)
        torch.testing.assert_close(part, b_ref.grad)
    return True


@pytest.mark.parametrize("sp", [False, True])
def test_row_parallel_linear_matches_linear(sp):
    assert all(run_world(_row, 2, sp, True))


def _embedding(rank, world, sp):
    g = Topology.build(tp=world, dp=1, pp=1, rank=rank).tp_group
    vocab = 16
    w = rand(vocab, H, seed=8)
    ids = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(9))
    dy = rand(S, B, H, seed=10)
    w_ref = w.clone().requires_grad_(True)
    F.embedding(ids, w_ref).backward(dy)
    layer = VocabParallelEmbedding(vocab, H, g, sequence_parallel=sp)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.info.shard.take(w, g.rank, g.size))
    y = layer(ids)
    y.backward(seq_shard(dy, g) if sp else dy)
    ref = F.embedding(ids, w)
    torch.testing.assert_close(y, seq_shard(ref, g) if sp else ref)
    torch.testing.assert_close(
        layer.weight.grad, layer.weight.info.shard.take(w_ref.grad, g.rank, g.size)
    )
    return True


@pytest.mark.parametrize("world,sp", [(2, False), (2, True), (4, True)])
def test_vocab_parallel_embedding_matches_embedding(world, sp):
    assert all(run_world(_embedding, world, sp))


def _cross_entropy(rank, world, vocab, padded):
    g = Topology.build(tp=world, dp=1, pp=1, rank=rank).tp_group
    logits = rand(S, B, padded, seed=11)
    target = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(12))
    ref_logits = logits[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none")
    weight = torch.rand(S * B, generator=torch.Generator().manual_seed(13))  # per-token grads
    (ref * weight).sum().backward()
    n = padded // g.size
    local = logits[..., g.rank * n : (g.rank + 1) * n].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, g, vocab)
    (loss.reshape(-1) * weight).sum().backward()
    torch.testing.assert_close(loss.reshape(-1), ref)
    full_grad = torch.cat([ref_logits.grad, torch.zeros(S, B, padded - vocab)], dim=-1)
    torch.testing.assert_close(local.grad, full_grad[..., g.rank * n : (g.rank + 1) * n])
    return True


@pytest.mark.parametrize(
    "world,vocab,padded", [(1, 20, 32), (1, 32, 32), (2, 20, 32), (4, 29, 32), (2, 32, 32)]
)
def test_vocab_parallel_cross_entropy_matches_cross_entropy(world, vocab, padded):
    assert all(run_world(_cross_entropy, world, vocab, padded))


def _mappings(rank, world):
    g = Topology.build(tp=world, dp=1, pp=1, rank=rank).tp_group
    x = rand(S, B, H, seed=13).requires_grad_(True)
    # gather_from_sp forward all-gathers; backward reduce-scatters (sum over ranks).
    y = gather_from_sp(seq_shard(x, g), g)
    torch.testing.assert_close(y, x)
    xs = seq_shard(x, g).detach().requires_grad_(True)
    gather_from_sp(xs, g).backward(torch.ones(S, B, H))
    torch.testing.assert_close(xs.grad, torch.full_like(xs, float(world)))
    # reduce_scatter_to_sp sums then shards; backward all-gathers.
    z = reduce_scatter_to_sp(x.detach(), g)
    torch.testing.assert_close(z, seq_shard(x.detach(), g) * world)
    # scatter / gather on the last dim are inverses.
    torch.testing.assert_close(gather_from_tp(scatter_to_tp(x.detach(), g), g), x.detach())
    torch.testing.assert_close(gather_from_sp(scatter_to_sp(x.detach(), g), g), x.detach())
    return True


def test_mapping_pairs_are_duals():
    assert all(run_world(_mappings, 2))
