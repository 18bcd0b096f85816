"""The weight-grad store (split backward) and the tensor-parallel layers' use of it: a backward
inside ``deferring`` (B) leaves every weight grad to ``run`` (W), which gives the plain
backward's grads bit for bit in fp32."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatronish.distributed.topology import Topology
from megatronish.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatronish.tensor_parallel.split_linear import add_bias, linear
from megatronish.tensor_parallel.weight_grad import (
    WeightGradStore,
    attach_weight_grad_store,
    weight_grads,
)
from megatronish.testing.multiproc import run_world
from megatronish.testing.split_backward import assert_split_backward

S, B, H, OUT = 8, 2, 12, 16


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def leaf(t):
    return t.detach().clone().requires_grad_(True)


# -- the store ------------------------------------------------------------------------------------
def test_deferring_refuses_nesting_and_a_key_still_queued():
    store = WeightGradStore()
    with store.deferring((0, 0)):
        assert store.deferring_now
        with pytest.raises(RuntimeError, match="already deferring"):
            with store.deferring((1, 0)):
                pass
    assert not store.deferring_now
    with pytest.raises(RuntimeError, match="already queued"):
        with store.deferring((0, 0)):
            pass
    store.run((0, 0))
    with store.deferring((0, 0)):  # run: the key may be deferred again
        pass


def test_run_of_a_key_never_queued_or_already_run_is_refused():
    store = WeightGradStore()
    with pytest.raises(RuntimeError, match="no weight grads were queued"):
        store.run((0, 0))
    with store.deferring((0, 0)):
        pass
    store.run((0, 0))
    with pytest.raises(RuntimeError, match="no weight grads were queued"):
        store.run((0, 0))


def test_defer_outside_deferring_is_refused_and_weight_grads_runs_the_job_at_once():
    store, p = WeightGradStore(), torch.zeros(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="only inside"):
        store.defer(lambda: [])
    for s in (None, store):
        assert weight_grads(s, lambda: [(p, torch.ones(3))])[id(p)].tolist() == [1.0] * 3
    with store.deferring("k"):
        assert weight_grads(store, lambda: [(p, torch.ones(3))]) is None
    assert p.grad is None
    store.run("k")
    assert p.grad.tolist() == [1.0] * 3


def test_pending_keys_in_queueing_order_until_run():
    store = WeightGradStore()
    keys = [(0, 1), (1, 1), (0, 0), (2, 1)]
    for k in keys:
        with store.deferring(k):
            pass
    assert store.pending == keys
    store.run((1, 1))
    assert store.pending == [(0, 1), (0, 0), (2, 1)]
    for k in store.pending:
        store.run(k)
    assert store.pending == []


def test_one_post_accumulate_hook_call_per_param_per_run():
    """A weight used by two linears of one key (two jobs): W sums both grads and its
    post-accumulate hook (ZeRO's readiness count) fires once, as once per plain backward; the
    sum equals the plain backward's bit for bit. (B may run the hook too, with no grad: torch
    runs a leaf's accumulation, hooks included, for a None grad; see weight_grad.py.)"""
    w, x = rand(H, H, seed=1), rand(S, B, H, seed=2)
    grads, calls = {}, {}
    for mode in ("plain", "deferred"):
        weight, store = leaf(w), WeightGradStore()
        calls[mode] = 0

        def hook(p, mode=mode):
            calls[mode] += 1

        weight.register_post_accumulate_grad_hook(hook)
        xl = leaf(x)
        y = linear(torch.tanh(linear(xl, weight, store=store)), weight, store=store)
        if mode == "plain":
            y.sum().backward()
        else:
            with store.deferring(0):
                y.sum().backward()
            assert weight.grad is None
            calls[mode] = 0  # W's calls only
            store.run(0)
        grads[mode] = weight.grad
    assert calls == {"plain": 1, "deferred": 1}
    assert torch.equal(grads["plain"], grads["deferred"])


def test_attach_reaches_every_layer_that_declares_a_store():
    g = Topology.build(tp=1, dp=1, pp=1, rank=0).tp_group
    model = nn.Sequential(ColumnParallelLinear(H, OUT, g), nn.ReLU(), RowParallelLinear(OUT, H, g))
    store = WeightGradStore()
    attach_weight_grad_store(model, store)
    assert model[0].weight_grad_store is store and model[2].weight_grad_store is store
    attach_weight_grad_store(model, None)
    assert model[0].weight_grad_store is None


# -- one op ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(S, B, H), (S * B, H), "transposed"])
def test_linear_gives_f_linear_grads_at_once_and_deferred(bias, shape):
    """Contiguous 3-d and 2-d inputs (the model's) bit for bit; a transposed input too."""
    x = rand(B, S, H, seed=3).transpose(0, 1) if shape == "transposed" else rand(*shape, seed=3)
    w, b = rand(OUT, H, seed=4), rand(OUT, seed=5)
    dy = rand(*x.shape[:-1], OUT, seed=6)
    want = [leaf(t) for t in (x, w, b)]
    y_ref = F.linear(want[0], want[1], want[2] if bias else None)
    y_ref.backward(dy)
    for defer in (False, True):
        got, store = [leaf(t) for t in (x, w, b)], WeightGradStore()
        y = linear(got[0], got[1], got[2] if bias else None, store)
        assert torch.equal(y, y_ref)
        if defer:
            with store.deferring(0):
                y.backward(dy)
            assert got[1].grad is None and got[2].grad is None
            assert torch.equal(got[0].grad, want[0].grad)
            store.run(0)
        else:
            y.backward(dy)
        assert torch.equal(got[0].grad, want[0].grad)
        assert torch.equal(got[1].grad, want[1].grad)
        assert (got[2].grad is None) == (not bias)
        if bias:
            assert torch.equal(got[2].grad, want[2].grad)


def test_add_bias_and_autocast_linear_give_torchs_grads():
    """The bias added after a reduction; and the linear under bf16 autocast, whose grads reach
    the fp32 weight through autograd's cast as from autocast's."""
    y, b, dy = rand(S, B, OUT, seed=1), rand(OUT, seed=2), rand(S, B, OUT, seed=3)
    want, got, store = [leaf(y), leaf(b)], [leaf(y), leaf(b)], WeightGradStore()
    (want[0] + want[1]).backward(dy)
    with store.deferring(0):
        add_bias(got[0], got[1], store).backward(dy)
    assert got[1].grad is None
    store.run(0)
    assert all(torch.equal(g.grad, r.grad) for g, r in zip(got, want))

    x, w = rand(S, B, H, seed=4), rand(OUT, H, seed=5)
    want, got, store = [leaf(x), leaf(w)], [leaf(x), leaf(w)], WeightGradStore()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = F.linear(*want)
        y = linear(*got, store=store)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    y_ref.backward(dy.bfloat16())
    with store.deferring(0):
        y.backward(dy.bfloat16())
    store.run(0)
    assert got[1].grad.dtype == torch.float32
    assert all(torch.equal(g.grad, r.grad) for g, r in zip(got, want))


# -- the layers -----------------------------------------------------------------------------------
class Stack(nn.Module):
    """embedding -> column-parallel -> gelu -> row-parallel (+ bias): every tp layer, every
    weight; from ids (the embedding's grad is all W) or from hidden states."""

    def __init__(self, g, sp: bool, bias: bool):
        super().__init__()
        self.embedding = VocabParallelEmbedding(32, H, g, sequence_parallel=sp)
        self.fc1 = ColumnParallelLinear(H, OUT, g, bias=bias, sequence_parallel=sp)
        self.fc2 = RowParallelLinear(OUT, H, g, bias=bias, sequence_parallel=sp)
        with torch.no_grad():
            for n, p in self.named_parameters():
                p.copy_(rand(*p.shape, seed=len(n) + g.rank))

    def forward(self, x):
        if not x.is_floating_point():
            x = self.embedding(x)
        return self.fc2(F.gelu(self.fc1(x)))


def stack_forwards(stack, g, sp):
    forwards = []
    for i in range(2):
        ids = torch.randint(0, 32, (S, B), generator=torch.Generator().manual_seed(i))
        x = rand(S // g.size if sp else S, B, H, seed=10 + i + g.rank)
        forwards += [lambda ids=ids: (None, stack(ids)), hidden_forward(stack, x)]
    return forwards


def hidden_forward(module, x):
    def forward():
        x_leaf = leaf(x)
        return x_leaf, module(x_leaf)

    return forward


def _layers(rank, world, sp, bias):
    g = Topology.build(tp=world, dp=1, pp=1, rank=rank).tp_group
    stack = Stack(g, sp, bias)
    assert_split_backward(stack, stack_forwards(stack, g, sp))
    return True


@pytest.mark.parametrize("bias", [False, True])
def test_tp_layers_split_on_one_rank(bias):
    assert _layers(0, 1, False, bias)


@pytest.mark.parametrize("sp", [False, True])
def test_tp_layers_split_on_two_ranks(sp):
    """tp = 2: the embedding's vocabulary split (ids outside a rank's range), the gathered
    input of a sequence-parallel column-parallel linear kept for W, the bias after the
    reduce-scatter."""
    assert all(run_world(_layers, 2, sp, True))
