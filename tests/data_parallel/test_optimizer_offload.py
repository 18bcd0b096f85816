"""Optimizer offload (parallel.optimizer_offload): the update on the host, bit for bit the one on
the device, with copies that complete late as they would on a GPU."""

import pytest
import torch

from megatronish.checkpoint.gather import gather_tp_params
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.testing.late_transfers import LateTransfers
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, losses_of, merge_params, train_layout
from megatronish.testing.runs import test_config as tiny_config

STEPS = 4
CLIP = ["optimizer.grad_clip=0.3"]  # clipping active: the scale reaches the host update


def _train(rank, world, overrides, late):
    transfers = LateTransfers() if late else None
    trainer = build_trainer(rank, world, [*CLIP, *overrides], STEPS, transfers=transfers)
    history = trainer.fit()
    for i in range(len(trainer.chunks)):
        trainer.zero.gather(i)
    params = gather_tp_params(trainer.chunks, trainer.topo)
    copies = transfers.copies if late else {}
    losses = [r.loss for r in history]
    norms = [r.grad_norm for r in history]
    return losses, norms, params, copies, trainer.zero.state_bytes()


LAYOUTS = [
    (1, []),
    (2, ["parallel.zero_stage=1"]),
    (2, ["parallel.zero_stage=2", "trainer.precision=bf16"]),
    (2, ["parallel.zero_stage=3"]),
    (4, ["parallel.zero_stage=3", "parallel.zero_shard_size=2", "parallel.pp=2"]),
    (2, ["parallel.zero_stage=1", "parallel.grad_compression=int8"]),
]


@pytest.mark.parametrize("world,layout", LAYOUTS, ids=[" ".join(x) or "one" for _, x in LAYOUTS])
def test_the_host_update_equals_the_device_update_bit_for_bit(world, layout):
    """Grads go down per bucket, the host updates, params come up per bucket, every copy late:
    losses, grad norms and params equal the run without offload exactly."""
    plain = run_world(_train, world, layout, False)
    offloaded = run_world(_train, world, [*layout, "parallel.optimizer_offload=true"], True)
    for (a_loss, a_norm, a_params, _, _), (b_loss, b_norm, b_params, copies, held) in zip(
        plain, offloaded
    ):
        assert list(map(repr, a_loss)) == list(map(repr, b_loss))  # nan off the last stage
        assert a_norm == b_norm
        assert all(torch.equal(a_params[k], b_params[k]) for k in a_params)
        assert copies["down"] > 0 and copies["up"] > 0  # the update really went through the host
        assert held["host"] > 0


def test_an_offloaded_run_resumes_bit_identically_and_its_checkpoint_loads_without(tmp_path):
    offload = ["parallel.zero_stage=1", "parallel.optimizer_offload=true"]
    sched = ["scheduler.decay_steps=6"]
    straight = run_world(train_layout, 2, [*sched, *offload], 6)
    saved = run_world(train_layout, 2, [*sched, *offload], 3, None, str(tmp_path))
    resumed = run_world(train_layout, 2, [*sched, *offload], 6, str(tmp_path))
    assert losses_of(saved) + losses_of(resumed) == losses_of(straight)
    a, b = merge_params(straight), merge_params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    plain = run_world(train_layout, 2, [*sched, "parallel.zero_stage=1"], 6, str(tmp_path))
    assert losses_of(plain) == losses_of(resumed)  # the same state, on the device


@pytest.mark.parametrize(
    "layout",
    [["parallel.zero_stage=1", "trainer.precision=bf16"], ["parallel.zero_stage=3"]],
    ids=["zero1-bf16", "zero3-fp32"],
)
def test_the_planner_moves_the_optimizer_state_to_the_host_as_the_runtime_does(layout):
    """Device bytes drop by the main params (bf16) and the Adam moments; the host holds them,
    the grads copied down and (bf16) the staging copy of the updated params."""
    overrides = [*layout, "parallel.optimizer_offload=true"]
    held = run_world(train_layout, 2, overrides, 1)[0].state_bytes
    cfg = tiny_config(overrides, 1)
    states = make_plan(spec_of(cfg), layout_from_config(cfg, 2)).stages[0].states
    assert (states.params, states.grads, states.optimizer) == (held["params"], held["grads"], 0)
    assert states.host == held["host"] + held["optimizer"]  # the moments live on the host
    plain = make_plan(spec_of(cfg), layout_from_config(cfg, 2).with_(optimizer_offload=False))
    moved = plain.stages[0].states.total - states.total
    main = states.owned_numel * 4 if "trainer.precision=bf16" in layout else 0
    assert moved == 2 * states.owned_numel * 4 + main
