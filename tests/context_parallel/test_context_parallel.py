"""Context parallelism: the load-balanced split, attention over a split sequence, and training
in every composition equal to one process (fp32, gloo)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant

from megatronish.context_parallel.attention import CPContext, causal_mask, cp_causal_attention
from megatronish.context_parallel.split import (
    chunk_ids,
    local_positions,
    natural_order,
    rank_major_order,
    split_sequence,
)
from megatronish.distributed.comm import ParallelGroup
from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import train_layout

# Two microbatches of 4 per step, as the tp/pp parity tests.
ARGS = ["trainer.micro_batch_size=4"]
STEPS = 6
_REF: dict[str, list] = {}


def reference(arch: str = "llama", extra: tuple[str, ...] = ()) -> list:
    key = f"{arch} {extra}"
    if key not in _REF:
        _REF[key] = [train_layout(0, 1, [*ARGS, f"model.arch={arch}", *extra], STEPS)]
    return _REF[key]


# -- the split (pure) -----------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_ranks_hold_every_position_once_with_equal_causal_work(cp):
    seq = 16 * cp
    held = [local_positions(seq, cp, r) for r in range(cp)]
    assert sorted(p for ps in held for p in ps) == list(range(seq))
    # Causal work of a token = the keys it attends to = its position + 1: equal on every rank.
    work = {sum(p + 1 for p in ps) for ps in held}
    assert len(work) == 1
    for r in range(cp):
        assert chunk_ids(cp, r) == (r, 2 * cp - 1 - r)
        x = torch.arange(seq).view(1, seq)
        assert split_sequence(x, 1, cp, r).flatten().tolist() == held[r]
    order = natural_order(cp)
    assert sorted(order) == list(range(2 * cp))
    assert [rank_major_order(cp)[i] for i in order] == list(range(2 * cp))


def test_uneven_sequences_are_refused():
    with pytest.raises(ValueError, match="not divisible by 2\\*cp = 4"):
        local_positions(10, 2, 0)


# -- attention on local queries (one process: the whole K/V given) --------------------------
@pytest.mark.parametrize("cp", [2, 4])
def test_local_queries_against_whole_kv_equal_full_causal_attention(cp):
    torch.manual_seed(0)
    b, heads, kv_heads, s, d = 2, 4, 2, 8 * cp, 8
    q = torch.randn(b, heads, s, d, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, requires_grad=True)
    v = torch.randn(b, kv_heads, s, d, requires_grad=True)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn_like(full)
    full.backward(grad)
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    for r in range(cp):
        ctx = CPContext(group=ParallelGroup("cp", tuple(range(cp)), r), seq_length=s)
        local_q = split_sequence(q, 2, cp, r)
        out = cp_causal_attention(local_q, k, v, ctx, 0.0)
        torch.testing.assert_close(out, split_sequence(full, 2, cp, r), rtol=0, atol=1e-6)
        out.backward(split_sequence(grad, 2, cp, r))  # grads accumulate over the ranks
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_gpu_mask_is_the_cpu_mask():
    """On CUDA the mask is torch's lower-right causal bias (no mask tensor); it must select the
    same keys as the boolean mask the CPU path builds."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    cpu = causal_mask(4, 12, torch.device("cpu"))
    assert cpu.dtype == torch.float32 and (cpu[0] == 0).sum() == 9 and (cpu[-1] == 0).all()
    assert (cpu[0, 9:] == float("-inf")).all()
    gpu = causal_mask(4, 12, torch.device("cuda"))  # builds no tensor: usable on CPU too
    assert isinstance(gpu, CausalBias) and gpu.variant == CausalVariant.LOWER_RIGHT
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=cpu)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=gpu), a)


# -- training parity ------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_matches_serial(arch, cp):
    got = run_world(train_layout, cp, [*ARGS, f"model.arch={arch}", f"parallel.cp={cp}"], STEPS)
    assert_parity(reference(arch), got)


COMPOSED = {
    "tp2-sp-cp2": (4, ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2"]),
    "cp2-dp2-zero1": (4, ["parallel.cp=2", "parallel.zero_stage=1"]),
    "cp2-dp2-zero2": (4, ["parallel.cp=2", "parallel.zero_stage=2"]),
    "cp2-zero3": (2, ["parallel.cp=2", "parallel.zero_stage=3"]),
    "cp2-pp2-vpp2": (4, ["parallel.cp=2", "parallel.pp=2", "parallel.vpp=2"]),
    "cp2-recompute-full": (2, ["parallel.cp=2", "trainer.recompute=full"]),
    "cp2-recompute-selective": (2, ["parallel.cp=2", "trainer.recompute=selective"]),
    "tp2-cp2-pp2-sp-zero1": (
        8,
        [
            "parallel.tp=2",
            "parallel.cp=2",
            "parallel.pp=2",
            "parallel.sp=true",
            "parallel.zero_stage=1",
        ],
    ),
}


@pytest.mark.parametrize("name", list(COMPOSED))
def test_cp_composes_with_every_dimension(name):
    world, layout = COMPOSED[name]
    got = run_world(train_layout, world, [*ARGS, *layout], STEPS, timeout=300)
    assert_parity(reference(), got)


@pytest.mark.parametrize(
    "layout",
    [["parallel.pp=2"], ["parallel.tp=2", "parallel.sp=true"]],
    ids=["tied-across-stages", "positions-under-sp"],
)
def test_gpt2_learned_positions_and_tied_embeddings_with_cp(layout):
    got = run_world(train_layout, 4, [*ARGS, "model.arch=gpt2", "parallel.cp=2", *layout], STEPS)
    assert_parity(reference("gpt2"), got)


# -- all-to-all (heads exchanged for sequence) -----------------------------------------------
A2A = ["parallel.cp_comm_type=a2a"]
# The exchange is the same for either arch and every ZeRO stage (it moves activations only):
# gpt2 runs once (cp 4), ZeRO once (stage 1 under pp).
A2A_CASES = {
    "cp4-gpt2": (4, "gpt2", ["parallel.cp=4"]),
    "tp2-sp-cp2-selective": (
        4,
        "llama",
        ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2", "model.num_query_groups=4"],
    ),
    "cp2-pp2-zero1-full-recompute": (
        4,
        "llama",
        ["parallel.cp=2", "parallel.pp=2", "parallel.zero_stage=1", "trainer.recompute=full"],
    ),
    "cp2-documents": (
        2,
        "llama",
        ["parallel.cp=2", "data.reset_attention_mask=true", "data.reset_position_ids=true"],
    ),
    "cp2-ep2-moe": (
        2,
        "llama",
        ["parallel.cp=2", "parallel.ep=2", "model.moe.num_experts=4", "model.moe.top_k=2"],
    ),
}


@pytest.mark.parametrize("name", list(A2A_CASES))
def test_all_to_all_cp_matches_serial(name):
    world, arch, layout = A2A_CASES[name]
    model = tuple(x for x in layout if x.startswith(("model.", "data.")))
    if name.endswith("selective"):
        layout = [*layout, "trainer.recompute=selective"]
    got = run_world(
        train_layout, world, [*ARGS, f"model.arch={arch}", *layout, *A2A], STEPS, timeout=300
    )
    assert_parity(reference(arch, model), got)


def _exchange_round_trip(rank: int, world: int) -> dict:
    from megatronish.context_parallel.head_exchange import heads_to_sequence, qkv_to_heads
    from megatronish.distributed.topology import Topology

    topo = Topology.build(tp=1, cp=world, dp=1, pp=1, rank=rank)
    gen = torch.Generator().manual_seed(0)
    s, b, heads, kv, d = 8 * world, 2, 4, 2 * world, 3
    whole = [torch.randn(s, b, n, d, generator=gen) for n in (heads, kv, kv)]
    mine = [split_sequence(t, 0, world, rank).requires_grad_() for t in whole]
    q, k, v = qkv_to_heads(*mine, topo.cp_group)
    group = [slice(rank * n // world, (rank + 1) * n // world) for n in (heads, kv, kv)]
    exact = all(torch.equal(got, t[:, :, g]) for got, t, g in zip((q, k, v), whole, group))
    back = heads_to_sequence(q * 2, topo.cp_group)
    back.sum().backward()
    return {
        "exchanged": exact,
        "back": torch.equal(back, 2 * mine[0]),
        "grad": torch.equal(mine[0].grad, torch.full_like(mine[0], 2.0)),
        "untouched": mine[1].grad is None or not mine[1].grad.any(),
    }


@pytest.mark.parametrize("cp", [2, 4])
def test_the_exchange_gives_each_rank_the_whole_sequence_of_its_heads(cp):
    """Each rank gets its head group's whole sequence in order (grouped-query heads aligned
    with their queries'), the way back is the inverse, and backward runs both the other way."""
    for result in run_world(_exchange_round_trip, cp):
        assert result == {"exchanged": True, "back": True, "grad": True, "untouched": True}
