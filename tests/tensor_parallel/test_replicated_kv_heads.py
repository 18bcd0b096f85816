"""Fewer key/value heads than tp ranks: each kv head replicated on tp / kv ranks (MQA, GQA)."""

import pytest
import torch

from megatronish.checkpoint.format import read_metadata, resolve_step_dir
from megatronish.tensor_parallel.sharding import TPShard
from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import (
    PARITY_STEPS,
    build_trainer,
    losses_of,
    merge_params,
    train_layout,
)

ARGS = ["trainer.micro_batch_size=4"]  # the tiny model: 8 query heads of width 8


def test_a_block_of_fewer_heads_than_ranks_is_replicated_on_consecutive_ranks():
    # q | k | v of 4 query heads and 2 kv heads of width 3 over tp=4: each rank holds one query
    # head and kv head r // 2, which ranks 0 and 2 hold the first copies of.
    shard = TPShard(dim=0, blocks=(12, 6, 6), heads=(4, 2, 2))
    full = torch.arange(24.0)
    shards = [shard.take(full, r, 4) for r in range(4)]
    assert shard.local_size(4) == 9 and all(s.numel() == 9 for s in shards)
    assert shards[1].tolist() == [3.0, 4.0, 5.0, 12.0, 13.0, 14.0, 18.0, 19.0, 20.0]
    assert torch.equal(shards[2][3:], shards[3][3:]) and not torch.equal(shards[1], shards[2])
    assert [shard.first_copy(1, r, 4) for r in range(4)] == [True, False, True, False]
    assert shard.replicates(4) and not shard.replicates(2)
    assert torch.equal(shard.join(shards), full)
    # At tp=2 the same shard splits every block, as one without heads does.
    plain = TPShard(dim=0, blocks=(12, 6, 6))
    assert all(torch.equal(shard.take(full, r, 2), plain.take(full, r, 2)) for r in range(2))


# MQA at tp=2 (with the qkv bias: its kv rows are replicated too), GQA 2 at tp=4 with sp, and
# MQA under ZeRO 3 beside dp (the replicated rows' grads are summed before the reduce-scatter).
# Each is slow: its one-process reference trains before the world starts (~4-6 s).
CASES = [
    pytest.param(
        ["model.num_query_groups=1", "model.bias=true"],
        2,
        ["parallel.tp=2"],
        marks=pytest.mark.slow,
    ),
    pytest.param(
        ["model.num_query_groups=2"],
        4,
        ["parallel.tp=4", "parallel.sp=true"],
        marks=pytest.mark.slow,
    ),
    pytest.param(
        ["model.num_query_groups=1"],
        4,
        ["parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=3"],
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("model,world,layout", CASES, ids=["mqa-tp2-bias", "gqa2-tp4-sp", "mqa-z3"])
def test_replicated_kv_heads_match_one_process(model, world, layout):
    ref = [train_layout(0, 1, [*ARGS, *model], PARITY_STEPS)]
    assert_parity(ref, run_world(train_layout, world, [*ARGS, *model, *layout], PARITY_STEPS))


def _kv_rows_after_training(rank: int, world: int, overrides: list[str]) -> torch.Tensor:
    trainer = build_trainer(rank, world, overrides, steps=3)
    for _ in range(3):
        trainer.train_step()
    attention = trainer.chunks[0].layers["0"].attn
    kv_rows = 2 * attention.kv_heads * attention.spec.head_dim
    return attention.qkv.weight.detach()[-kv_rows:].clone()


def test_the_copies_of_a_kv_head_stay_identical():
    """Every copy gets the summed grad, so the replicas never drift apart (their losses would
    differ from one process's only once they had)."""
    rows = run_world(
        _kv_rows_after_training, 2, [*ARGS, "model.num_query_groups=1", "parallel.tp=2"]
    )
    assert torch.equal(rows[0], rows[1])


STOP, END = 3, 6
SCHED = [f"scheduler.decay_steps={END}"]


def _run(world, layout, steps, load=None, save=None):
    args = ([*ARGS, *SCHED, "model.num_query_groups=2", *layout], steps, load, save)
    if world == 1:
        return [train_layout(0, 1, *args)]
    return run_world(train_layout, world, *args, timeout=300)


def test_a_tp4_checkpoint_of_gqa2_stores_each_kv_head_once_and_reshards_both_ways(tmp_path):
    ref = _run(1, [], END)
    to_one, to_four = tmp_path / "tp4", tmp_path / "tp1"
    saved = _run(4, ["parallel.tp=4"], STOP, save=str(to_one))
    meta = read_metadata(resolve_step_dir(str(to_one)))
    for name, entry in meta.tensors.items():  # disjoint and complete: each kv head once
        covered = sum(int(torch.tensor([n for _, n in s.offsets]).prod()) for s in entry.shards)
        assert covered == int(torch.tensor(entry.shape).prod()), name
    resumed = _run(1, [], END, load=str(to_one))
    saved_back = _run(1, [], STOP, save=str(to_four))
    resumed_back = _run(4, ["parallel.tp=4"], END, load=str(to_four))
    for first, second in ((saved, resumed), (saved_back, resumed_back)):
        joined = losses_of(first) + losses_of(second)
        norms = first[0].grad_norms + second[0].grad_norms
        got = [type(ref[0])(losses=joined, grad_norms=norms, params=merge_params(second))]
        assert_parity(ref, got)
