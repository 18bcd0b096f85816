"""Split backward of the mixture-of-experts layers: the experts' stacks (torch's grouped matmul
and our loop) and the router hand their grads to W; B keeps the rows' grad (and dispatch's
backward); W gives the plain backward's grads bit for bit in fp32."""

import pytest
import torch

from megatronish.model.gpt import GPTChunk
from megatronish.model.parallel_context import ParallelContext
from megatronish.model.recompute import apply_recompute
from megatronish.moe.experts import GroupedExperts
from megatronish.moe.grouped_mm import (
    expert_offsets,
    grouped_linear,
    torch_version,
    use_grouped_mm,
)
from megatronish.spec import ModelSpec, MoESpec
from megatronish.tensor_parallel.context import TPContext
from megatronish.tensor_parallel.random import RNGTracker
from megatronish.tensor_parallel.weight_grad import WeightGradStore
from megatronish.testing.split_backward import assert_split_backward

S, B = 8, 2
HAS_GROUPED_MM = use_grouped_mm("cpu", torch.float32, torch_version())
PATHS = [
    pytest.param(
        True,
        id="grouped_mm",
        marks=pytest.mark.skipif(not HAS_GROUPED_MM, reason="torch < 2.9 has no CPU grouped_mm"),
    ),
    pytest.param(False, id="loop"),
]


def spec_of(arch: str = "llama", shared: int = 1) -> ModelSpec:
    moe = MoESpec(
        num_experts=4,
        top_k=2,
        layer_freq=1,
        ffn_hidden_size=24,
        shared_experts=shared,
        aux_loss_coef=0.01,
        z_loss_coef=1e-3,
    )
    return ModelSpec(
        arch=arch,
        num_layers=2,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=2,
        ffn_hidden_size=32,
        seq_length=S,
        vocab_size=64,
        padded_vocab_size=128,
        max_position_embeddings=S,
        hidden_dropout=0.1,
        moe=moe,
    )


def randomize(module: torch.nn.Module, scale: float = 0.1) -> None:
    with torch.no_grad():
        for n, p in sorted(module.named_parameters()):
            gen = torch.Generator().manual_seed(len(n) + p.numel())
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


@pytest.mark.parametrize("grouped", PATHS)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_experts_split(grouped, arch):
    """Both stacks' grads in W, an expert without rows included."""
    experts = GroupedExperts(spec_of(arch), 1, 4, 0, grouped=grouped)
    randomize(experts)
    counts = [5, 0, 7, 4]
    rows = [torch.randn(16, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def forward(r):
        def run():
            x = r.detach().clone().requires_grad_()
            return x, experts(x, counts)

        return run

    assert_split_backward(experts, [forward(r) for r in rows])


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="torch < 2.9 has no CPU grouped_mm")
@pytest.mark.parametrize("expanded", [False, True], ids=["dense_grad", "expanded_grad"])
def test_grouped_mm_grads_are_torchs_autograd_bitwise(expanded):
    """Ours (with a store, not deferring) runs the two grouped matmuls torch's backward of
    ``torch._grouped_mm`` runs (a layer without a store runs torch's); an expanded output grad
    (a ``sum``'s) is made contiguous first on both paths."""
    counts = [5, 0, 7, 4]
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    w = torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(2))
    dy = torch.randn(16, 24, generator=torch.Generator().manual_seed(3))
    offs = expert_offsets(counts, x.device)

    def backward(out):
        (out.sum() if expanded else (out * dy).sum()).backward()

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    reference = grouped_linear(xr, wr, counts, offs, grouped=True)  # no store: torch's autograd
    assert type(reference.grad_fn).__name__ == "GroupedMmBackward0"
    backward(reference)
    xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = grouped_linear(xo, wo, counts, offs, grouped=True, store=WeightGradStore())
    assert type(out.grad_fn).__name__ == "_GroupedMMBackward"
    backward(out)
    assert torch.equal(xo.grad, xr.grad) and torch.equal(wo.grad, wr.grad)


def chunk_forwards(chunk, spec, rng):
    forwards = []
    for i in range(2):
        gen = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(0, spec.vocab_size, (B, S + 1), generator=gen)
        hidden = torch.randn(S, B, spec.hidden_size, generator=gen)

        def forward(ids=ids, hidden=hidden, seed=7 + i):
            rng.seed(seed, 0)
            if chunk.first:
                return None, chunk(ids[:, :-1], ids[:, 1:])
            x = hidden.clone().requires_grad_()
            return x, chunk(x, ids[:, 1:])

        forwards.append(forward)
    return forwards


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("grouped", PATHS)
@pytest.mark.parametrize("first", [True, False], ids=["whole", "tail"])
def test_moe_chunk_backward_splits(first, grouped, recompute):
    """Router, experts (grouped or loop), shared experts, norms, attention and head: every
    parameter's grad in W; the balancing and z losses reach the router through W too."""
    spec = spec_of()
    rng = RNGTracker(torch.device("cpu"))
    chunk = GPTChunk(spec, ParallelContext(TPContext(rng=rng)), range(2), first=first, last=True)
    randomize(chunk, 0.05)
    for block in chunk.layers.values():
        block.mlp.experts.grouped = grouped
    apply_recompute([chunk], recompute, "uniform", 1, rng)
    assert_split_backward(chunk, chunk_forwards(chunk, spec, rng))
