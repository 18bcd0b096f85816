"""Ring attention (parallel.cp_comm_type=ring): the block rule, its kernels, NCCL-safe posts, and
training equal to one process."""

import pytest
import torch

from megatronish.context_parallel.attention import CPContext
from megatronish.context_parallel.ring import (
    DIAGONAL,
    FIRST_KEYS,
    block_part,
    ring_attention,
    ring_owner,
    ring_posts,
)
from megatronish.context_parallel.ring_kernel import (
    block_attention,
    block_backward,
    block_kernel,
    math_block_attention,
    math_block_backward,
    merge_block,
    unseen_rows,
)
from megatronish.context_parallel.split import chunk_ids
from megatronish.distributed.comm import ParallelGroup
from megatronish.pipeline.nccl_sim import P2P, DeadlockError, MismatchError, run_groups
from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.recording_p2p import RecordingP2P
from megatronish.testing.runs import (
    PACKED_DOCUMENTS,
    PARITY_STEPS,
    one_process_reference,
    train_layout,
)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_every_visible_chunk_pair_is_attended_once(cp):
    """Over the cp steps each rank's query chunks meet exactly the key chunks at or before
    them (the diagonal ones causally) and no others."""
    for rank in range(cp):
        mine = chunk_ids(cp, rank)
        seen = []
        for step in range(cp):
            owner = ring_owner(rank, step, cp)
            part, theirs = block_part(rank, owner), chunk_ids(cp, owner)
            if part == DIAGONAL:
                seen += [(mine[0], mine[0]), (mine[1], mine[0]), (mine[1], mine[1])]
            elif part == FIRST_KEYS:
                seen += [(q, theirs[0]) for q in mine]
            else:
                seen += [(mine[1], k) for k in theirs]
        visible = [(q, k) for q in mine for k in range(2 * cp) if k <= q]
        assert sorted(seen) == sorted(visible), (cp, rank)
        assert sorted({ring_owner(rank, s, cp) for s in range(cp)}) == list(range(cp))


def _sim_groups(posts_of, layers: int) -> dict:
    return {
        rank: [
            [P2P(kind, peer, message, ()) for kind, peer, message in group]
            for _ in range(layers)
            for group in posts
        ]
        for rank, posts in posts_of.items()
    }


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_the_ring_posts_never_deadlock_under_nccl_order(cp):
    """Three layers' forward then their backward: every group completes with NCCL's
    rendezvous sends, and every pair's messages match in order."""
    forward = {r: ring_posts(r, cp, backward=False) for r in range(cp)}
    backward = {r: ring_posts(r, cp, backward=True) for r in range(cp)}
    groups = {r: _sim_groups(forward, 3)[r] + _sim_groups(backward, 3)[r] for r in range(cp)}
    try:
        report = run_groups(groups)
    except (DeadlockError, MismatchError) as e:  # the simulator's verdict: NCCL would hang
        pytest.fail(f"cp={cp}: {e}")
    per_rank = 3 * (cp - 1) + 3 * (2 * cp - 1)  # sends per rank: K/V blocks and dK/dV
    assert report.messages == cp * per_rank


def _qkv(heads=4, kv_heads=2, s=12, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, s, d, generator=g, dtype=dtype)
    k = torch.randn(2, kv_heads, s, d, generator=g, dtype=dtype)
    v = torch.randn(2, kv_heads, s, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
def test_the_cpu_block_kernel_equals_the_math_one(causal):
    q, k, v = _qkv()
    assert block_kernel("cpu", q.dtype, 8) == "cpu_flash"
    assert block_kernel("cuda", torch.bfloat16, 128) == "cuda_flash"
    assert block_kernel("cuda", torch.float32, 128) == "math"
    fused, math = block_attention(q, k, v, causal), math_block_attention(q, k, v, causal)
    torch.testing.assert_close(fused.out, math.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.lse, math.lse, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(q)
    got = block_backward(dout, q, k, v, fused.out, fused.lse, causal)
    want = math_block_backward(dout, q, k, v, math.out, math.lse, causal)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_masked_block_with_rows_that_see_nothing_merges_nothing_for_them():
    """Document masks: a row that sees no key of a block gets lse -inf and output 0 from
    ``unseen_rows`` (the CPU kernel alone would say lse 0), so merging it keeps what the row
    had; its backward through the block is zero; both kernels agree."""
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, 12, 12)
    mask[:, :, ::2, 3:] = float("-inf")  # even rows see keys 0-2 only
    mask[:, :, 5, :] = float("-inf")  # row 5 sees nothing
    seen = (mask == 0).any(dim=-1)
    fused = unseen_rows(block_attention(q, k, v, False, mask), seen)
    math = unseen_rows(math_block_attention(q, k, v, False, mask), seen)
    torch.testing.assert_close(fused.out, math.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.lse, math.lse, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(fused.lse[:, :, 5]).all() and (fused.out[:, :, 5] == 0).all()
    before = block_attention(q, k, v, causal=True)
    out, lse = merge_block(before.out.float(), before.lse, fused)
    torch.testing.assert_close(out[:, :, 5], before.out[:, :, 5])
    dout = torch.randn_like(q)
    got = block_backward(dout, q, k, v, out.to(q.dtype), lse, False, mask=mask)
    want = math_block_backward(dout, q, k, v, out.to(q.dtype), lse, False, mask)
    assert (got[0][:, :, 5] == 0).all()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_merged_blocks_and_their_backward_equal_attention_over_all_keys():
    """Keys split in two blocks, merged by log-sum-exp; each block's backward with the merged
    output and log-sum-exp: together the gradients of attention over every key."""
    q, k, v = _qkv()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kx, vx = (t.repeat_interleave(2, dim=1) for t in leaves[1:])
    want = torch.nn.functional.scaled_dot_product_attention(leaves[0], kx, vx)
    dout = torch.randn_like(want)
    want.backward(dout)
    halves = [(k[:, :, :5], v[:, :, :5]), (k[:, :, 5:], v[:, :, 5:])]
    out = lse = None
    for kb, vb in halves:
        out, lse = merge_block(out, lse, block_attention(q, kb, vb, causal=False))
    torch.testing.assert_close(out, want.detach(), atol=1e-5, rtol=1e-5)
    grads = [block_backward(dout, q, kb, vb, out, lse, causal=False) for kb, vb in halves]
    dq = grads[0][0] + grads[1][0]
    dk = torch.cat([grads[0][1], grads[1][1]], dim=2)
    dv = torch.cat([grads[0][2], grads[1][2]], dim=2)
    for got, leaf in zip((dq, dk, dv), leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_recorded_posts_are_the_plan_and_replay_under_nccl_order(cp):
    """Each rank's real forward and backward, run in turn in one process with a recording
    communicator (receives read zeros): its groups are :func:`ring_posts`', with the shapes
    of one rank's K|V block, and every rank's replay completes in the NCCL simulator."""
    groups = {}
    for rank in range(cp):
        ctx = CPContext(
            group=ParallelGroup(name="cp", ranks=tuple(range(cp)), rank=rank),
            seq_length=8 * cp,
            comm_type="ring",
            p2p=lambda group: RecordingP2P(),
        )
        q, k, v = (t.requires_grad_() for t in _qkv(s=8, seed=rank))
        ring_attention(q, k, v, ctx).sum().backward()
        recorded = ctx.communicator().groups
        planned = ring_posts(rank, cp, False) + ring_posts(rank, cp, True)
        assert [[(p.kind, p.peer, p.message) for p in g] for g in recorded] == planned
        assert {p.shape for g in recorded for p in g} == {(2, 4, 8, 8)}  # k|v of 2 kv heads
        groups[rank] = recorded
    run_groups(groups)


ARGS = ["trainer.micro_batch_size=4"]


RING = ["parallel.cp_comm_type=ring"]
CASES = [
    (("model.arch=gpt2",), 2, ["parallel.cp=2"], False),
    # GQA 2 over 4 cp ranks, posted with NCCL's ordering (a send completes at its receive)
    (("model.num_query_groups=2",), 4, ["parallel.cp=4"], True),
    (
        (),
        4,
        ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "trainer.recompute=selective"],
        False,
    ),
    (
        (),
        4,
        ["parallel.cp=2", "parallel.pp=2", "parallel.zero_stage=1", "trainer.recompute=full"],
        True,
    ),
    # packed documents: each block masked to the queries' own documents (rows that see none
    # of a block's keys merge nothing)
    (PACKED_DOCUMENTS, 2, ["parallel.cp=2"], False),
    (PACKED_DOCUMENTS, 4, ["parallel.cp=4"], True),
]


@pytest.mark.parametrize(
    "model,world,layout,strict",
    CASES,
    ids=[
        "gpt2-cp2",
        "gqa-cp4-strict",
        "tp2-sp-cp2-selective",
        "cp2-pp2-zero1-full-strict",
        "documents-cp2",
        "documents-cp4-strict",
    ],
)
def test_ring_attention_trains_like_one_process(model, world, layout, strict):
    got = run_world(
        train_layout, world, [*ARGS, *model, *layout, *RING], PARITY_STEPS, strict_p2p=strict
    )
    assert_parity(one_process_reference([*ARGS, *model]), got)


MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]


def test_ring_attention_with_expert_parallelism_trains_like_one_process():
    ref = one_process_reference([*ARGS, *MOE])
    layout = ["parallel.cp=2", "parallel.ep=2", *RING]
    assert_parity(ref, run_world(train_layout, 2, [*ARGS, *MOE, *layout], PARITY_STEPS))
