"""Split backward of the model's layers and whole chunks: a backward inside
``WeightGradStore.deferring`` (B) leaves every parameter's grad None and gives the plain
backward's input grad; ``run`` (W) gives the plain backward's grads, bit for bit in fp32."""

import pytest
import torch
import torch.nn.functional as F

from megatronish.context_parallel.attention import CPContext
from megatronish.distributed.comm import ParallelGroup
from megatronish.distributed.topology import Topology
from megatronish.model import rms_norm as rms
from megatronish.model.blocks import Norm
from megatronish.model.gpt import Embedding, GPTChunk
from megatronish.model.layer_norm import layer_norm
from megatronish.model.linear_cross_entropy import linear_cross_entropy
from megatronish.model.parallel_context import ParallelContext
from megatronish.model.recompute import apply_recompute
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.context import TPContext
from megatronish.tensor_parallel.random import RNGTracker
from megatronish.tensor_parallel.weight_grad import WeightGradStore, attach_weight_grad_store
from megatronish.testing.multiproc import run_world
from megatronish.testing.split_backward import assert_split_backward

S, B = 8, 2


def spec_of(arch: str, **kw) -> ModelSpec:
    base = dict(
        arch=arch,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2 if arch == "llama" else 4,
        ffn_hidden_size=48,
        seq_length=S,
        vocab_size=100,
        padded_vocab_size=128,
        max_position_embeddings=S,
        bias=arch == "gpt2",
        tie_embeddings=arch == "gpt2",
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    base.update(kw)
    return ModelSpec(**base)


def rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def forward_of(module, x, *args):
    """A forward for :func:`assert_split_backward`: ``module(leaf x, *args)``."""

    def forward():
        x_leaf = leaf(x) if x.is_floating_point() else x
        return (x_leaf if x.is_floating_point() else None), module(x_leaf, *args)

    return forward


# -- one layer ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(S, B, 32), (40, 3, 256)])
def test_norms_give_f_layer_norm_and_f_rms_norm_grads_at_once_and_deferred(shape):
    """With a residual beside the norm, as in a block: the input's grad sums the residual's and
    the norm's in torch's order."""
    h = shape[-1]
    x, w, b, dy = rand(*shape, seed=1), 1 + rand(h, seed=2), rand(h, seed=3), rand(*shape, seed=4)
    cases = [
        (
            lambda x, w, b, s: layer_norm(x, w, b, 1e-5, s),
            lambda x, w, b: F.layer_norm(x, (h,), w, b),
        ),
        (
            lambda x, w, b, s: rms.rms_norm(x, w, 1e-5, s),
            lambda x, w, b: F.rms_norm(x, (h,), w, 1e-5),
        ),
    ]
    for ours, ref in cases:
        want = [leaf(t) for t in (x, w, b)]
        y_ref = want[0] + ref(*want)
        y_ref.backward(dy)
        for defer in (False, True):
            got, store = [leaf(t) for t in (x, w, b)], WeightGradStore()
            y = got[0] + ours(*got, store)
            assert torch.equal(y, y_ref)  # the same forward kernels
            if defer:
                with store.deferring("k"):
                    y.backward(dy)
                assert got[1].grad is None and got[2].grad is None
                assert torch.equal(got[0].grad, want[0].grad)
                store.run("k")
            else:
                y.backward(dy)
            for g, r in zip(got, want):
                if r.grad is not None:
                    assert torch.equal(g.grad, r.grad)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_model_norm_splits(arch):
    norm = Norm(spec_of(arch), TPContext())
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(rand(*p.shape, seed=p.numel()))
    xs = [rand(S, B, 32, seed=10 + i) for i in range(2)]
    assert_split_backward(norm, [forward_of(norm, x) for x in xs])


def test_low_precision_rms_norm_splits_in_bf16():
    x, w = rand(S, B, 64, seed=1, dtype=torch.bfloat16), (1 + rand(64, seed=2)).bfloat16()
    dy = rand(S, B, 64, seed=3, dtype=torch.bfloat16)
    xa, wa = leaf(x), leaf(w)
    y = rms.low_precision_rms_norm(xa, wa, 1e-5, WeightGradStore())
    assert type(y.grad_fn).__name__.startswith("_LowPrecisionRMSNorm")
    y.backward(dy)
    store, xb, wb = WeightGradStore(), leaf(x), leaf(w)
    with store.deferring(0):
        rms.low_precision_rms_norm(xb, wb, 1e-5, store).backward(dy)
    assert wb.grad is None and store.pending == [0]
    torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=0)  # B: the same ops
    store.run(0)
    assert wb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(wb.grad, wa.grad, rtol=2**-7, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's fused RMSNorm is CUDA's")
def test_rms_norm_on_cuda_is_f_rms_norm_bitwise():
    x, w, dy = rand(64, 4, 256, seed=1), 1 + rand(256, seed=2), rand(64, 4, 256, seed=3)
    for dtype in (torch.float32, torch.bfloat16):
        want = [leaf(t.to("cuda", dtype)) for t in (x, w)]
        y_ref = F.rms_norm(*want[:1], (256,), want[1], 1e-5)
        y_ref.backward(dy.to("cuda", dtype))
        if rms.rms_norm_kernel("cuda", dtype, rms.TORCH_VERSION) != "torch":
            continue
        got, store = [leaf(t.to("cuda", dtype)) for t in (x, w)], WeightGradStore()
        y = rms.rms_norm(got[0], got[1], 1e-5, store)
        with store.deferring(0):
            y.backward(dy.to("cuda", dtype))
        store.run(0)
        assert torch.equal(y, y_ref)
        assert all(torch.equal(g.grad, r.grad) for g, r in zip(got, want))


@pytest.mark.parametrize("cp", [1, 2])
def test_learned_positions_split(cp):
    """cp = 1: the table's rows are a slice; cp = 2 (rank 1 of a group no collective uses): the
    rank's two chunks of positions, picked by an index."""
    spec = spec_of("gpt2", tie_embeddings=False, max_position_embeddings=cp * S)
    group = ParallelGroup("cp", tuple(range(cp)), cp - 1)
    embedding = Embedding(spec, TPContext(), CPContext(group=group, seq_length=cp * S)).eval()
    with torch.no_grad():
        for p in embedding.parameters():
            p.copy_(rand(*p.shape, seed=p.numel()))
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    ids = [torch.randint(0, spec.vocab_size, (B, S), generator=g) for g in gens]

    def forward(t):
        return lambda: (None, embedding(t))

    assert_split_backward(embedding, [forward(t) for t in ids])


def test_fused_head_loss_hands_its_weight_grad_to_w():
    """The tp = 1 head: B scales the hidden states' grad only, W scales and hands over the
    weight's grad computed in forward; a weight with an fp32 main grad gets it added there in W
    (never in B) and autograd a placeholder, as without deferring."""
    x, w = rand(12, 32, seed=1), rand(128, 32, seed=2).bfloat16()
    target = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(3))
    results = []
    for defer in (False, True):
        weight, added = leaf(w), []
        weight.accumulate_main_grad = lambda g, grad_is_placeholder, seen=added: seen.append(g)
        xb, store = leaf(x), WeightGradStore()
        loss = linear_cross_entropy(xb, weight, target, 100, store=store)
        if defer:
            with store.deferring(0):
                (loss * 0.5).backward()
            assert weight.grad is None and not added and xb.grad is not None
            store.run(0)
        else:
            (loss * 0.5).backward()
        assert len(added) == 1 and added[0].dtype == torch.float32
        assert weight.grad is not None and weight.grad.dtype == torch.bfloat16  # placeholder
        results.append((xb.grad, added[0]))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


# -- whole chunks ---------------------------------------------------------------------------------
RECOMPUTE = ["none", "selective", "full"]


def chunk_forwards(chunk, spec, rng, tp_rank=0, sp_size=1, microbatches=2):
    """Two microbatches' forwards (ids on a first chunk, hidden states otherwise; the loss on a
    last chunk), each reseeding the RNGs so that it repeats its dropout masks."""
    forwards = []
    for i in range(microbatches):
        gen = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(0, spec.vocab_size, (B, S + 1), generator=gen)
        hidden = torch.randn(S, B, spec.hidden_size, generator=gen)
        hidden = hidden.chunk(sp_size)[tp_rank]  # a sequence-parallel rank's shard
        x = ids[:, :-1] if chunk.first else hidden
        targets = ids[:, 1:] if chunk.last else None

        def forward(x=x, targets=targets, seed=7 + i):
            rng.seed(seed, tp_rank)
            x_leaf = leaf(x) if x.is_floating_point() else None
            return x_leaf, chunk(x if x_leaf is None else x_leaf, targets)

        forwards.append(forward)
    return forwards


def build_chunk(spec, ctx, part, recompute, rng):
    first, last = part in ("whole",), part in ("whole", "tail")
    chunk = GPTChunk(spec, ctx, range(spec.num_layers), first=first, last=last)
    with torch.no_grad():
        for n, p in sorted(chunk.named_parameters()):
            p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(n) * 7 + p.numel()))
            if n.endswith("norm.weight"):
                p.add_(1.0)
    apply_recompute([chunk], recompute, "uniform", 1, rng)
    return chunk


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("part", ["whole", "tail"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_chunk_backward_splits(arch, part, recompute):
    """``whole``: embedding (gpt2: its learned positions, and the head tied to its word
    embedding: two jobs of one parameter in one key) to loss; ``tail``: hidden states in (their
    grad is B's) to loss."""
    spec = spec_of(arch)
    rng = RNGTracker(torch.device("cpu"))
    ctx = ParallelContext(TPContext(rng=rng))
    chunk = build_chunk(spec, ctx, part, recompute, rng)
    assert_split_backward(chunk, chunk_forwards(chunk, spec, rng))


def test_middle_chunk_backward_splits():
    """Hidden states in and out (no embedding, no head), under full recompute."""
    spec = spec_of("llama")
    rng = RNGTracker(torch.device("cpu"))
    chunk = build_chunk(spec, ParallelContext(TPContext(rng=rng)), "middle", "full", rng)
    assert_split_backward(chunk, chunk_forwards(chunk, spec, rng))


def _tp_chunk(rank, world, part):
    topo = Topology.build(tp=world, dp=1, pp=1, rank=rank)
    torch.manual_seed(0)
    spec = spec_of("llama")
    rng = RNGTracker(torch.device("cpu"))
    ctx = ParallelContext(TPContext(group=topo.tp_group, sp=True, rng=rng))
    chunk = build_chunk(spec, ctx, part, "none", rng)
    forwards = chunk_forwards(chunk, spec, rng, tp_rank=rank, sp_size=world)
    assert_split_backward(chunk, forwards)
    return True


def test_tp2_sequence_parallel_chunk_backward_splits():
    """tp = 2 with sequence parallelism (llama): the tp collectives of the backward stay in B;
    every rank's B and W match its plain backward."""
    assert all(run_world(_tp_chunk, 2, "whole"))
    assert all(run_world(_tp_chunk, 2, "tail"))


def _node_names(out: torch.Tensor) -> set[str]:
    """The names of every autograd node behind ``out``."""
    seen, names, todo = set(), set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [next_fn for next_fn, _ in node.next_functions]
    return names


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_layers_without_a_store_run_torchs_own_autograd(arch):
    """The split functions are Python autograd nodes (tens of microseconds each on the host);
    1F1B, interleaved and unpipelined training attach no store and must not pay for them."""
    split = {
        "_LinearBackward",
        "_AddBiasBackward",
        "_LookupBackward",
        "_AddPositionsBackward",
        "_TorchRMSNormBackward",
        "_LayerNormBackward",
    }
    spec = spec_of(arch)
    rng = RNGTracker(torch.device("cpu"))
    chunk = build_chunk(spec, ParallelContext(TPContext(rng=rng)), "whole", "none", rng)
    (forward,) = chunk_forwards(chunk, spec, rng, microbatches=1)
    _, loss = forward()
    assert not _node_names(loss) & split
    store = WeightGradStore()
    attach_weight_grad_store(chunk, store)
    _, loss = forward()
    present = {"_LinearBackward", "_LookupBackward", "_TorchRMSNormBackward", "_LayerNormBackward"}
    if arch == "gpt2":
        present = (present - {"_TorchRMSNormBackward"}) | {
            "_AddBiasBackward",
            "_AddPositionsBackward",
        }
    else:
        present -= {"_LayerNormBackward"}
    assert present <= _node_names(loss)
