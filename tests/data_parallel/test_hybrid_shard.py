"""Hybrid sharding (parallel.zero_shard_size): ZeRO 1-3 inside shard groups, replicated across."""

import pytest
import torch

from megatronish.pipeline.no_pipeline import forward_backward_no_pipeline
from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, train_layout

CLIP = ["optimizer.grad_clip=0.3"]  # below the grad norms: the norm (replicas counted once) matters
REFERENCE: list = []

# Bytes per parameter held on one rank, by stage, with the states sharded over ``shard`` ranks.
FORMULA = {1: lambda shard: 8 + 8 / shard, 2: lambda shard: 4 + 12 / shard, 3: lambda s: 16 / s}


def reference():
    if not REFERENCE:
        REFERENCE.append(train_layout(0, 1, CLIP))
    return REFERENCE


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shard_groups_of_two_on_four_dp_ranks_match_one_process(stage):
    got = run_world(
        train_layout, 4, [*CLIP, f"parallel.zero_stage={stage}", "parallel.zero_shard_size=2"]
    )
    assert_parity(reference(), got)
    for run in got:  # the states of a 2-rank ZeRO, not of a 4-rank one
        held = run.state_bytes
        total = held["params"] + held["grads"] + held["optimizer"]
        assert abs(total / (FORMULA[stage](2) * held["param_numel"]) - 1) < 0.02, held
        assert run.stats["zero_replica/all_reduce"]["calls"] > 0  # shards summed across replicas


def test_shard_groups_of_the_cp_ranks_replicated_over_dp_match_one_process():
    """zero_shard_size=1 under cp=2: each shard group is a cp pair, the dp ranks its replicas."""
    layout = ["parallel.cp=2", "parallel.zero_stage=2", "parallel.zero_shard_size=1"]
    got = run_world(train_layout, 4, [*CLIP, *layout])
    assert_parity(reference(), got)


def _replica_reduce_starts(rank, world):
    overrides = [
        "trainer.global_batch_size=16",
        "parallel.bucket_size_mb=0.05",
        "parallel.zero_stage=1",
        "parallel.zero_shard_size=2",
    ]
    trainer = build_trainer(rank, world, overrides, 1)
    zero, stats = trainer.zero, trainer.topo.stats
    batches = trainer.microbatches(trainer.train_data, 0)
    zero.start_step(len(batches))
    stats.reset()
    started = []
    for batch in batches:
        forward_backward_no_pipeline(trainer.chunks, [batch], loss_scale=0.5, param_hooks=zero)
        started.append(stats.calls[("zero_replica", "all_reduce")])
    zero.finish_reduction()
    early = len([b for b in zero.buckets if not b.late])
    return started, early, stats.calls[("zero_replica", "all_reduce")], len(zero.buckets)


def test_each_shard_is_all_reduced_over_the_replicas_during_the_last_backward():
    """A bucket's all-reduce across the replicas starts once its reduce-scatter is finished,
    while later buckets still compute: all but the last bucket reduced in backward have started
    when the last backward ends; each shard goes once per step."""
    for started, early, total, buckets in run_world(_replica_reduce_starts, 4):
        assert early > 2
        assert started == [0, early - 1], started
        assert total == buckets


BF16_HYBRID = [
    "trainer.precision=bf16",
    "trainer.global_batch_size=16",  # two microbatches per rank: shards accumulate first
    "model.num_layers=2",
    "parallel.bucket_size_mb=0.05",
    "parallel.zero_shard_size=2",
]


def _reduced_shards(rank, world, overrides):
    """This rank's reduced grad shards after one step's backward (before the update)."""
    trainer = build_trainer(rank, world, overrides, 1)
    zero = trainer.zero
    batches = trainer.microbatches(trainer.train_data, 0)
    zero.start_step(len(batches))
    forward_backward_no_pipeline(
        trainer.chunks, batches, loss_scale=1.0 / len(batches), param_hooks=zero
    )
    zero.finish_reduction()
    shard = trainer.topo.zero_shard_group.rank  # which shard of each bucket this rank owns
    return shard, [zero.owned_grad(b).clone() for b in zero.buckets]


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_reduced_shards_hold_the_sum_over_every_replica(stage):
    """grad_reduce_dtype=bf16 under hybrid sharding: each shard is reduce-scattered and then
    all-reduced over the replicas in bf16, and the sum copied back into the fp32 shard. The
    shards equal those of the same bf16 run reduced in fp32 within bf16 round-off (measured
    3e-3 of each shard's norm; a shard summed inside its shard group only is off by about the
    other replica's half of the batch, 0.6), and the replicas of a shard agree."""
    layout = [*BF16_HYBRID, f"parallel.zero_stage={stage}"]
    fp32 = run_world(_reduced_shards, 4, [*layout, "parallel.grad_reduce_dtype=fp32"])
    bf16 = run_world(_reduced_shards, 4, [*layout, "parallel.grad_reduce_dtype=bf16"])
    for rank, ((_, want), (_, got)) in enumerate(zip(fp32, bf16)):
        assert len(want) == len(got) > 2
        for a, b in zip(want, got):
            assert a.dtype == b.dtype == torch.float32
            gap = (b - a).norm() / a.norm()
            assert gap < 2e-2, (rank, gap)
    for shard in range(2):
        (_, grads), *others = [run for run in bf16 if run[0] == shard]
        assert len(others) == 1  # two replicas of each shard
        for a, b in zip(grads, others[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * a.abs().max().item())
