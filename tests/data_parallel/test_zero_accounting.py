"""ZeRO bookkeeping: bytes held per stage, bytes moved per step, when reductions start."""

import pytest
import torch

from megatronish.pipeline.no_pipeline import forward_backward_no_pipeline
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, train_layout

# Bytes per parameter (fp32 params, grads, Adam moments) held on one rank, by stage.
FORMULA = {
    0: lambda dp: 16,
    1: lambda dp: 8 + 8 / dp,
    2: lambda dp: 4 + 12 / dp,
    3: lambda dp: 16 / dp,
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_state_bytes_follow_the_zero_formulas(stage, dp):
    runs = run_world(train_layout, dp, [f"parallel.zero_stage={stage}"], 1)
    for run in runs:
        held = run.state_bytes
        total = held["params"] + held["grads"] + held["optimizer"]
        psi = held["param_numel"]
        assert abs(total / (FORMULA[stage](dp) * psi) - 1) < 0.02, (held, psi)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_grad_byte_is_reduced_once_per_step_or_microbatch(stage):
    dp, micro = 2, 2
    runs = run_world(
        train_layout,
        dp,
        [f"parallel.zero_stage={stage}", f"trainer.global_batch_size={2 * dp * micro}"],
        1,
    )
    run = runs[0]
    grad_bytes = 4 * run.state_bytes["buffer_numel"]
    buckets = run.state_bytes["buckets"]
    got = {k: v for k, v in run.stats.items() if k.startswith("dp/")}
    loss = {"calls": 1, "bytes": 4}  # the step's mean loss, one float
    if stage == 0:
        expected = {"dp/all_reduce": {"calls": buckets + 1, "bytes": grad_bytes + 4}}
    else:
        rounds = micro if stage >= 2 else 1  # zero 2/3 reduce every microbatch
        gathers, gathered = buckets, grad_bytes  # zero 1/2: once, after the update
        if stage == 3:  # every unit before its forward and its backward, the loss's once
            units = run.state_bytes["units"]
            gathers = micro * sum(n * (1 if holds else 2) for _, n, holds in units)
            gathered = micro * 4 * sum(numel * (1 if holds else 2) for numel, _, holds in units)
        expected = {
            "dp/all_reduce": loss,
            "dp/reduce_scatter": {"calls": rounds * buckets, "bytes": rounds * grad_bytes},
            "dp/all_gather": {"calls": gathers, "bytes": gathered},
        }
    assert got == expected


def _overlap(rank, world):
    trainer = build_trainer(
        rank, world, ["trainer.global_batch_size=16", "parallel.bucket_size_mb=0.05"], 1
    )
    zero, stats = trainer.zero, trainer.topo.stats
    batches = trainer.microbatches(trainer.train_data, 0)
    assert len(batches) == 4 and len(zero.buckets) > 2
    zero.start_step(len(batches))
    stats.reset()
    for i, batch in enumerate(batches):
        forward_backward_no_pipeline(trainer.chunks, [batch], loss_scale=0.25, param_hooks=zero)
        dp_calls = sum(v for (g, _), v in stats.calls.items() if g == "dp")
        if i < len(batches) - 1:
            assert dp_calls == 0, "no communication during earlier microbatches"
    launched = dp_calls
    zero.finish_reduction()
    return launched, len([b for b in zero.buckets if not b.late])


def test_bucket_reductions_start_during_the_last_backward():
    for launched, buckets in run_world(_overlap, 2):
        assert launched == buckets  # every bucket launched from its hook, before the step ends


def test_bf16_holds_bf16_params_beside_fp32_main_params_and_tracks_fp32():
    ref = train_layout(0, 1, [], 3)
    runs = run_world(
        train_layout,
        4,
        ["trainer.precision=bf16", "parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=1"],
        3,
    )
    losses = next(r.losses for r in runs if r.losses[0] == r.losses[0])
    assert all(abs(a - b) / a < 2e-2 for a, b in zip(ref.losses, losses))
    params = {k: v for r in runs for k, v in r.params.items()}
    assert all(v.dtype == torch.bfloat16 for v in params.values())
    for r in runs:  # bf16 model params (2 bytes) + fp32 main params of the dp shard (4 / dp)
        held = r.state_bytes
        assert held["params"] == held["buffer_numel"] * 2 + held["buffer_numel"] // 2 * 4
        assert held["grads"] == held["buffer_numel"] * 4
