"""ZeRO at scale: per-unit gathering with prefetch (zero 3), gathers that overlap the next forward
(zero 1/2), full grads only per bucket (zero 2/3), and the planner's account of all three."""

import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from megatronish.config.compose import load_config
from megatronish.data_parallel import grad_reduce, param_gather
from megatronish.data_parallel.grad_reduce import MAX_IN_FLIGHT
from megatronish.data_parallel.param_gather import ParamGatherer
from megatronish.distributed import gloo_shards
from megatronish.distributed.comm import ParallelGroup, all_gather_into, reduce_scatter_into
from megatronish.plan.candidates import valid_layouts
from megatronish.plan.data_parallel import ChunkUnits, gathers_per_microbatch, peak_gathered
from megatronish.plan.estimate import Planner, make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.testing.memory import measure_step, run_profiled_world
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer
from megatronish.testing.runs import test_config as tiny_config

ZERO3_LAYOUTS = [
    (2, []),
    (2, ["model.arch=gpt2"]),  # embedding and head are one unit (tied within the chunk)
    (2, ["trainer.recompute=full", "trainer.recompute_num_layers=2"]),
    (2, ["trainer.recompute=full", "trainer.recompute_num_layers=4"]),  # all blocks recomputed
    (2, ["trainer.recompute=full", "trainer.recompute_method=block"]),
    (4, ["parallel.pp=2", "parallel.vpp=2", "model.arch=gpt2"]),
    (4, ["parallel.tp=2", "parallel.sp=true", "parallel.bucket_size_mb=0.01"]),
]


def _counting_gathers(trainer, step) -> list[tuple[bool, int, float]]:
    """Run ``step()`` counting the all-gathers into each ZeRO 3 unit's buckets: per unit
    ``(holds the head, its buckets, all-gathers per microbatch)``."""
    units = [u for us in trainer.zero.units_of for u in us]
    unit_of = {id(b.param_flat): k for k, u in enumerate(units) for b in u.buckets}
    calls = Counter()
    real = param_gather.all_gather_into

    def counting(out, shard, group, async_op=False):
        calls[unit_of.get(id(out))] += 1
        return real(out, shard, group, async_op=async_op)

    param_gather.all_gather_into = counting
    try:
        step()
    finally:
        param_gather.all_gather_into = real
    m = trainer.derived.num_microbatches
    heads = [getattr(c, "head", None) for c in trainer.chunks]
    return [
        (any(mod is heads[u.chunk] for mod in u.modules), len(u.buckets), calls[k] / m)
        for k, u in enumerate(units)
    ]


def _peaks(rank, world, overrides):
    trainer = build_trainer(rank, world, overrides, 3)
    zero = trainer.zero
    trainer.train_step()
    gatherer = zero.gatherer
    gatherer.peak_gathered_numel = gatherer.gathered_numel
    zero.peak_grad_numel = 0
    gathers = _counting_gathers(trainer, trainer.train_step)
    return trainer.topo.coords.pp, gatherer.peak_gathered_numel, zero.peak_grad_numel, gathers


@pytest.mark.parametrize(
    "world,extra", ZERO3_LAYOUTS, ids=[" ".join(x) or "plain" for _, x in ZERO3_LAYOUTS]
)
def test_zero3_holds_what_the_planner_says(world, extra):
    overrides = ["parallel.zero_stage=3", "trainer.global_batch_size=16", *extra]
    cfg = tiny_config(overrides, 3)
    plan = make_plan(spec_of(cfg), layout_from_config(cfg, world))
    for pp_rank, gathered, grads, gathers in run_world(_peaks, world, overrides):
        states = plan.stages[pp_rank].states
        assert gathered * 4 == states.params_step, (pp_rank, gathered)
        if world == 2 and "trainer.recompute_num_layers=4" not in extra:
            # Two blocks (or the tied embedding+head and two blocks) of four: not the chunk.
            assert states.params_step <= 0.6 * states.buffer_numel * 4
        assert 0 < grads * 4 <= states.grads_step, (pp_rank, grads)
        # Per microbatch each unit is gathered for its forward and for its backward, but the
        # head's (the loss's; with pp = 1 gpt2's tied embedding+head, the largest unit), which
        # stays gathered from its forward to its backward: once per bucket.
        assert [calls for _, _, calls in gathers] == [
            buckets * (1 if head else 2) for head, buckets, _ in gathers
        ], gathers
        calls = sum(calls for _, _, calls in gathers) * plan.layout.num_microbatches
        assert calls == plan.stages[pp_rank].comm["dp/all_gather"][0]


def test_planned_gathered_peak_follows_prefetch_loss_and_recompute():
    sizes = ((1,), (10,), (10,), (10,), (3,))  # embedding, three blocks, head (the loss)
    plain = ChunkUnits(sizes, (0, 1, 2, 3, 4), 4, ((1, 4, False),))
    assert peak_gathered(plain) == 20  # a block and the next one prefetched
    recompute_all = ChunkUnits(sizes, (0, 1, 2, 3, 4), 4, ((1, 4, True),))
    assert peak_gathered(recompute_all) == 30  # the recompute holds every block of the segment
    tied = ChunkUnits(((4,), (10,), (10,)), (0, 1, 2, 0), 0, ((1, 3, False),))
    assert peak_gathered(tied) == 24  # embedding+head stays whole from first to last use
    assert gathers_per_microbatch(plain) == (9, 65)  # the loss's unit once, the others twice


# -- gathers are waited for before use ---------------------------------------------------------
class _DeferredGather:
    """An all-gather that has not happened until ``wait``: the destination holds nan."""

    def __init__(self, out, shard, group):
        self.out, self.shard, self.group = out, shard.clone(), group
        out.fill_(float("nan"))

    def wait(self):
        REAL_ALL_GATHER(self.out, self.shard, self.group)

    def is_completed(self):
        return False


class _DeferredReduce:
    """A reduce-scatter that reads its input only at ``wait``: reusing the buffer before the
    wait (as NCCL, which reads it on its own stream, would punish) changes the result."""

    def __init__(self, out, full, group):
        self.out, self.full, self.group = out, full, group

    def wait(self):
        REAL_REDUCE_SCATTER(self.out, self.full, self.group)

    def is_completed(self):
        return False


REAL_ALL_GATHER = param_gather.all_gather_into
REAL_REDUCE_SCATTER = grad_reduce.reduce_scatter_into


def _deferred_all_gather(out, shard, group, async_op=False):
    if not async_op or group.size == 1:
        return REAL_ALL_GATHER(out, shard, group, async_op=async_op)
    return _DeferredGather(out, shard, group)


def _deferred_reduce_scatter(out, full, group, async_op=False):
    if not async_op or group.size == 1:
        return REAL_REDUCE_SCATTER(out, full, group, async_op=async_op)
    return _DeferredReduce(out, full, group)


def _losses(rank, world, overrides, defer, break_waits=False):
    if defer:
        param_gather.all_gather_into = _deferred_all_gather
        grad_reduce.reduce_scatter_into = _deferred_reduce_scatter
    if break_waits:  # the construction this test guards, broken: params used before the wait
        wait_all = ParamGatherer.wait_updated
        ParamGatherer.wait_updated = lambda self, unit=None: (
            wait_all(self) if unit is None else None
        )
        ParamGatherer.ensure = ParamGatherer.start_gather
    trainer = build_trainer(rank, world, overrides, 3)
    losses = [trainer.train_step().loss for _ in range(3)]
    trainer.zero.finish_param_gather()
    return losses


INTERLEAVED = ["parallel.pp=2", "parallel.vpp=2", "model.arch=gpt2"]


@pytest.mark.parametrize(
    "stage,extra", [(1, []), (2, []), (3, []), (1, INTERLEAVED), (3, INTERLEAVED)]
)
def test_every_unit_waits_for_its_gather_before_use(stage, extra):
    """Gathers complete only when waited for (their buffers hold nan until then) and reductions
    read their input only then: the run is still exact, so every forward and backward waited for
    its own params first and no grad buffer was reused before its reduction completed."""
    overrides = [f"parallel.zero_stage={stage}", "trainer.global_batch_size=16", *extra]
    world = 4 if extra else 2
    plain = run_world(_losses, world, overrides, False)
    deferred = run_world(_losses, world, overrides, True)
    held = [x for r in plain for x in r if not math.isnan(x)]  # ranks holding the loss
    assert held and all(math.isfinite(x) for x in held)
    assert str(deferred) == str(plain)  # bit-identical (nan on ranks without the loss)
    broken = run_world(_losses, world, overrides, True, True)
    assert any(
        math.isnan(x) or x != y
        for r, p in zip(broken, plain)
        for x, y in zip(r, p)
        if not math.isnan(y)
    )


def _pending_after_step(rank, world, overlap):
    trainer = build_trainer(
        rank, world, ["parallel.zero_stage=1", f"parallel.overlap_param_gather={overlap}"], 2
    )
    trainer.train_step()
    pending = sum(b.extra.get("gather_work") is not None for b in trainer.zero.buckets)
    losses = [trainer.train_step().loss]
    return pending, losses


def test_zero1_param_gather_overlaps_the_next_forward():
    on = run_world(_pending_after_step, 2, True)
    off = run_world(_pending_after_step, 2, False)
    assert all(pending > 0 for pending, _ in on)  # still in flight when the step returned
    assert all(pending == 0 for pending, _ in off)
    assert [losses for _, losses in on] == [losses for _, losses in off]  # bit-identical


# -- memory per stage --------------------------------------------------------------------------
# Parameters dominate (hidden 256, seq 16, micro batch 1), two microbatches per rank.
PARAMS_HEAVY = [
    "model.num_layers=8",
    "model.hidden_size=256",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=704",
    "model.vocab_size=1000",
    "trainer.micro_batch_size=1",
    "trainer.global_batch_size=4",
    "parallel.bucket_size_mb=1",
]


def _step_peak(rank, world, stage):
    trainer = build_trainer(rank, world, [*PARAMS_HEAVY, f"parallel.zero_stage={stage}"], 8)
    trainer.train_step()
    runs = [measure_step(trainer) for _ in range(4)]
    complete = [m for m in runs if m.activations is not None]
    return min(
        m.params + m.grads + m.optimizer + m.activations + m.gathered_params for m in complete
    )


def test_peak_memory_falls_with_every_stage():
    peaks = [sorted(run_profiled_world(_step_peak, 2, stage))[0] for stage in range(4)]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3], peaks
    assert peaks[3] < 0.65 * peaks[0], peaks  # states 8 of 16 bytes per parameter, plus a few units


def _grad_buffers(rank, world, stage):
    trainer = build_trainer(
        rank,
        world,
        [*PARAMS_HEAVY, f"parallel.zero_stage={stage}", "parallel.bucket_size_mb=0.5"],
        2,
    )
    trainer.train_step()
    zero = trainer.zero
    largest = max(b.numel for b in zero.buckets if not b.late)
    total = sum(b.numel for b in zero.buckets)
    return zero.peak_grad_numel, largest, total


@pytest.mark.parametrize("stage", [2, 3])
def test_full_grads_live_only_per_bucket(stage):
    for peak, largest, total in run_world(_grad_buffers, 2, stage):
        assert peak <= (MAX_IN_FLIGHT + 1) * largest < total / 2, (peak, largest, total)


def test_keep_gathered_gathers_once_per_step():
    overrides = [
        "parallel.zero_stage=3",
        "parallel.zero3_keep_gathered=true",
        "trainer.global_batch_size=16",
    ]
    cfg = tiny_config(overrides, 3)
    plan = make_plan(spec_of(cfg), layout_from_config(cfg, 2))
    states = plan.stages[0].states
    m = plan.layout.num_microbatches
    for _, gathered, _, gathers in run_world(_peaks, 2, overrides):
        assert gathered * 4 == states.params_step == states.buffer_numel * 4
        assert m > 1 and [calls * m for _, _, calls in gathers] == [b for _, b, _ in gathers]


# -- planner and advisor at GPU scale ---------------------------------------------------------
def test_planner_and_advisor_count_two_blocks_not_the_whole_model():
    cfg = load_config(["+experiment=gpt_1b", "model.vocab_size=32000"])
    spec = spec_of(cfg)
    base = layout_from_config(cfg, 8).with_(tp=1, pp=1, vpp=1, dp=8, sp=False, zero_stage=3)
    plan = make_plan(spec, base)
    states = plan.stages[0].states
    model_bytes = states.buffer_numel * base.activation_bytes
    block_bytes = model_bytes / spec.num_layers  # about: the embedding and head are extra
    assert states.params_step < 2.5 * block_bytes < 0.15 * model_bytes
    # A device just large enough for this layout: the advisor's candidates hold it and its fit
    # check (a representative plan of one planner) keeps it, where gathering the whole chunk
    # (the model, with pp = 1) would not have fitted.
    limit = plan.peak_bytes
    assert plan.peak_bytes - states.params_step + model_bytes > limit
    assert base in valid_layouts(cfg, 8, spec.vocab_size)
    assert Planner(spec).plan(base, representative=True).fits(limit, 0)


# -- gloo: flat collectives as broadcasts / reduces --------------------------------------------
def _flat_collectives(rank, world, decompose):

    group = ParallelGroup("dp", tuple(range(world)), rank, dist.group.WORLD)
    group.decompose_gloo_shards = decompose
    n = 6 * world
    out = torch.full((n,), -1.0)
    shard = torch.arange(6.0) + 100 * rank
    work = all_gather_into(out, shard, group, async_op=True)
    work.wait()
    inplace = out.clone()  # zero 1/2: the shard is this rank's slice of the output
    inplace[6 * rank : 6 * rank + 6] = shard + 1
    all_gather_into(inplace, inplace[6 * rank : 6 * rank + 6], group)
    full = torch.arange(float(n)) * (rank + 1)
    reduced = torch.empty(6)
    reduce_scatter_into(reduced, full, group, async_op=True).wait()
    full2 = torch.arange(float(n)) * (rank + 1)
    reduce_scatter_into(full2[6 * rank : 6 * rank + 6], full2, group)  # into its own slice
    return (
        out,
        inplace,
        reduced,
        full2[6 * rank : 6 * rank + 6].clone(),
        gloo_shards.decomposes(group),
    )


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_flat_collectives_equal_the_native_ones(world):
    decomposed = run_world(_flat_collectives, world, True)
    native = run_world(_flat_collectives, world, False)
    for d, n in zip(decomposed, native):
        assert d[-1] and not n[-1]
        for a, b in zip(d[:-1], n[:-1]):
            assert a.equal(b)
    ranks = sum(range(1, world + 1))
    assert decomposed[1][2].equal(torch.arange(6.0, 12.0) * ranks)


def _native_losses(rank, world, stage):
    trainer = build_trainer(rank, world, [f"parallel.zero_stage={stage}"], 3)
    trainer.topo.dp_group.decompose_gloo_shards = False  # the collectives NCCL runs
    return [trainer.train_step().loss for _ in range(3)]


@pytest.mark.parametrize("stage", [1, 3])
def test_native_collectives_train_the_same(stage):
    native = run_world(_native_losses, 2, stage)
    decomposed = run_world(_losses, 2, [f"parallel.zero_stage={stage}"], False)
    assert native == decomposed


# -- zero 3: backward prefetch -----------------------------------------------------------------
def _backward_gathers(rank, world, overrides):
    """For every unit a backward needs: was its all-gather already started when the unit was
    needed, and during which visit's backward (the visit index in forward order)?"""
    trainer = build_trainer(rank, world, ["parallel.zero_stage=3", *overrides], 2)
    g = trainer.zero.gatherer
    real = {n: getattr(g, n) for n in ("before_backward", "start_gather", "after_compute")}
    now = {"visit": None, "first": True}  # the backward visit running; first of its compute?
    started, needed = {}, []

    def start_gather(unit):
        if not unit.gathered:  # an all-gather starts here
            started[id(unit)] = now["visit"]
        real["start_gather"](unit)

    def before_backward(visits, i):
        unit = visits[i].unit
        needed.append((unit.chunk, i, now["first"], unit.gathered, started.get(id(unit))))
        now["visit"], now["first"] = i, False
        real["before_backward"](visits, i)

    def after_compute(chunk_index, kind):
        real["after_compute"](chunk_index, kind)
        now["visit"], now["first"] = None, True  # the next compute begins

    g.start_gather, g.after_compute = start_gather, after_compute
    g.before_backward = before_backward
    for _ in range(2):
        trainer.train_step()
    return needed


def test_zero3_backward_prefetches_the_next_unit_while_the_current_one_runs():
    """In backward each unit's all-gather starts when the backward of the unit after it (in
    forward order) begins, so it overlaps that compute; only the first unit of a chunk's
    backward (the loss's, kept from its forward) is not prefetched that way."""
    for needed in run_world(_backward_gathers, 2, []):
        later = [n for n in needed if not n[2]]
        assert len(needed) == 2 * 2 * 6 and len(later) == 2 * 2 * 5  # steps x mbs x visits
        for chunk, i, _, gathering, started_at in later:
            assert gathering and started_at == i + 1, (chunk, i, gathering, started_at)
