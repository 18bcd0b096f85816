"""Optimizer offload (parallel.optimizer_offload): the update on the host, bit for bit the one on
the device, with copies that complete late as they would on a GPU."""

import pytest
import torch

from megatronish.checkpoint.gather import gather_tp_params
from megatronish.data_parallel.pinned_memory import pinned_block_bytes
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.testing.late_transfers import LateTransfers
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, losses_of, merge_params, train_layout
from megatronish.testing.runs import test_config as tiny_config

STEPS = 4
CLIP = ["optimizer.grad_clip=0.3"]  # clipping active: the scale reaches the host update


def _first_uses(trainer) -> list[int]:
    """Filled as the forwards run: the buckets (indices into ``trainer.zero.buckets``) in the
    order the first forward uses one of their params (a pre-hook on every module holding
    params)."""
    bucket_of = {id(p): k for k, b in enumerate(trainer.zero.buckets) for _, p in b.params}
    order: list[int] = []

    def note(module, _args):
        for p in module.parameters(recurse=False):
            k = bucket_of.get(id(p))
            if k is not None and k not in order:
                order.append(k)

    for chunk in trainer.chunks:
        for module in chunk.modules():
            if next(module.parameters(recurse=False), None) is not None:
                module.register_forward_pre_hook(note)
    return order


def _uploads(trainer, transfers) -> list[int]:
    """The buckets (indices into ``trainer.zero.buckets``) whose params went up, in the order
    their copies were queued."""
    index = {id(b.param_shard): k for k, b in enumerate(trainer.zero.buckets)}
    return [index[id(dst)] for _, dst, _ in transfers.up]


def _train(rank, world, overrides, late):
    transfers = LateTransfers() if late else None
    trainer = build_trainer(rank, world, [*CLIP, *overrides], STEPS, transfers=transfers)
    first_uses = _first_uses(trainer)
    history = trainer.fit()
    uploads = _uploads(trainer, transfers) if late else []
    for i in range(len(trainer.chunks)):
        trainer.zero.gather(i)
    params = gather_tp_params(trainer.chunks, trainer.topo)
    copies = transfers.copies if late else {}
    losses = [r.loss for r in history]
    norms = [r.grad_norm for r in history]
    return losses, norms, params, copies, trainer.zero.state_bytes(), (uploads, first_uses)


LAYOUTS = [
    (1, []),
    (2, ["parallel.zero_stage=1"]),
    (2, ["parallel.zero_stage=2", "trainer.precision=bf16"]),
    (2, ["parallel.zero_stage=3"]),
    (4, ["parallel.zero_stage=3", "parallel.zero_shard_size=2", "parallel.pp=2"]),
    (2, ["parallel.zero_stage=1", "parallel.grad_compression=int8"]),
]


LAYOUT_IDS = [" ".join(x) or "one" for _, x in LAYOUTS]
OFFLOADED: dict[tuple, list] = {}  # each layout's offloaded run, trained once per module


def offloaded_run(world: int, layout: list[str]) -> list:
    key = (world, tuple(layout))
    if key not in OFFLOADED:
        overrides = [*layout, "parallel.optimizer_offload=true"]
        OFFLOADED[key] = run_world(_train, world, overrides, True)
    return OFFLOADED[key]


@pytest.mark.parametrize("world,layout", LAYOUTS, ids=LAYOUT_IDS)
def test_the_host_update_equals_the_device_update_bit_for_bit(world, layout):
    """Grads go down per bucket, the host updates, params come up per bucket, every copy late:
    losses, grad norms and params equal the run without offload exactly."""
    plain = run_world(_train, world, layout, False)
    offloaded = offloaded_run(world, layout)
    for (a_loss, a_norm, a_params, _, _, _), (b_loss, b_norm, b_params, copies, held, _) in zip(
        plain, offloaded
    ):
        assert list(map(repr, a_loss)) == list(map(repr, b_loss))  # nan off the last stage
        assert a_norm == b_norm
        assert all(torch.equal(a_params[k], b_params[k]) for k in a_params)
        assert copies["down"] > 0 and copies["up"] > 0  # the update really went through the host
        assert held["host"] > 0


# ZeRO 2/3 cut a bucket per unit; zero 0/1 put the tiny model in one bucket (no order to show).
PER_UNIT = [(w, x) for w, x in LAYOUTS if {"parallel.zero_stage=2", "parallel.zero_stage=3"} & {*x}]


@pytest.mark.parametrize("world,layout", PER_UNIT, ids=[" ".join(x) for _, x in PER_UNIT])
def test_params_go_up_in_the_order_the_next_forward_uses_them(world, layout):
    """Each step copies every bucket's updated params up once, in the order the forward first
    uses them: the copies run one after the other, so the first unit's gather (or forward)
    waits only for its own copy, not for the whole model's (the values are the same in any
    order; only the order of the copies shows it)."""
    for _, _, _, _, _, (uploads, first_uses) in offloaded_run(world, layout):
        assert sorted(first_uses) == list(range(len(first_uses))) and len(first_uses) > 1
        assert uploads == first_uses * STEPS


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
    # The moments live on the host (pageable); the planned slabs are as a GPU pins them, one
    # per kind rounded up to a power of two (test_offload_pinned.py), pageable and exact here.
    per_kind = [4, 4, 2] if "trainer.precision=bf16" in layout else [4, 4]
    assert held["host"] == states.owned_numel * sum(per_kind)
    pinned = sum(pinned_block_bytes(states.owned_numel * b) for b in per_kind)
    assert states.host == pinned + held["optimizer"]
    plain = make_plan(spec_of(cfg), layout_from_config(cfg, 2).with_(optimizer_offload=False))
    moved = plain.stages[0].states.total - states.total
    main = states.owned_numel * 4 if "trainer.precision=bf16" in layout else 0
    assert moved == 2 * states.owned_numel * 4 + main
