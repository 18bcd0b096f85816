"""Hierarchical context parallelism (parallel.cp_comm_type=a2a_ring): heads exchanged inside
groups of cp_a2a_size consecutive cp ranks, K/V passed around a ring across the groups."""

import pytest
import torch

from megatronish.context_parallel.attention import reorder_chunks
from megatronish.context_parallel.split import local_positions, natural_order
from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import (
    PACKED_DOCUMENTS,
    PARITY_STEPS,
    one_process_reference,
    train_layout,
)


@pytest.mark.parametrize("cp,a2a", [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_an_a2a_group_holds_a_rings_share_of_the_sequence(cp, a2a):
    """The group's chunks, received rank-major and put in natural order (what the exchange
    does), are the positions a rank of the ring over cp / a2a ranks holds: the ring's block
    rule and document masks apply unchanged."""
    seq = 4 * cp
    for g in range(cp // a2a):
        members = [local_positions(seq, cp, g * a2a + i) for i in range(a2a)]
        received = torch.tensor([p for member in members for p in member])
        held = reorder_chunks(received, natural_order(a2a))
        assert held.tolist() == local_positions(seq, cp // a2a, g), (cp, a2a, g)


ARGS = ["trainer.micro_batch_size=4"]


A2A_RING = ["parallel.cp=4", "parallel.cp_comm_type=a2a_ring", "parallel.cp_a2a_size=2"]
CASES = {
    # GQA 2: each a2a member attends 2 query heads over 1 kv head; posted with NCCL's ordering
    "gqa-cp4-a2-strict": ((), 4, [], True),
    "gpt2-documents-cp4-a2-strict": (("model.arch=gpt2", *PACKED_DOCUMENTS), 4, [], True),
    # MHA: 2 query and 2 kv heads per tp rank, one of each per a2a member
    "mha-tp2-sp-cp4-a2-zero1-selective": (
        ("model.num_query_groups=4",),
        8,
        [
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.zero_stage=1",
            "trainer.recompute=selective",
        ],
        False,
    ),
    "cp4-a2-pp2-zero3-full-strict": (
        (),
        8,
        ["parallel.pp=2", "parallel.zero_stage=3", "trainer.recompute=full"],
        True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a2a_ring_trains_like_one_process(case):
    model, world, layout, strict = CASES[case]
    args = [*ARGS, *model, *A2A_RING, *layout]
    got = run_world(train_layout, world, args, PARITY_STEPS, strict_p2p=strict)
    assert_parity(one_process_reference([*ARGS, *model]), got)


MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]


def test_a2a_ring_with_expert_parallelism_trains_like_one_process():
    ref = one_process_reference([*ARGS, *MOE])
    got = run_world(train_layout, 4, [*ARGS, *MOE, *A2A_RING, "parallel.ep=2"], PARITY_STEPS)
    assert_parity(ref, got)
