"""The pipeline schedules in the plan (``parallel.pipeline_schedule``): each one's bubble, its
in-flight memory with what W keeps from B, its messages, and the advisor's choice among them."""

import random
import shutil

import pytest

from megatronish.config import compose
from megatronish.config.compose import load_config
from megatronish.model.flops import split_backward_times
from megatronish.pipeline.simulate import analytic_bubble, bubble_fraction, simulate
from megatronish.plan import dense, moe
from megatronish.plan.advisor import advise
from megatronish.plan.candidates import config_view, layout_errors, valid_layouts
from megatronish.plan.cli import main as plan_main
from megatronish.plan.estimate import Planner, make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.plan.pipeline import (
    bubble,
    capped_microbatches,
    embedding_volume,
    exposed_messages,
    p2p_buffers,
    peak_in_flight,
    pp_volume,
)
from megatronish.plan.recompute import recompute_flops_per_token
from megatronish.plan.report import write_parallel_file
from megatronish.plan.step_time import Hardware, step_time
from megatronish.testing.memory import activations_by_stage, measure_layout
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import test_config as tiny_config
from megatronish.testing.runs import train_layout

H100 = Hardware(peak_flops=989e12)
SIXTEEN_LAYERS = ["model.num_layers=16", "trainer.micro_batch_size=1"]
DEFAULT = {1: "1f1b", 2: "interleaved"}
ZERO_BUBBLE = {1: "zb-h1", 2: "zbv"}


def _tiny(extra=(), world=1):
    cfg = tiny_config([*SIXTEEN_LAYERS, *extra], 1)
    return spec_of(cfg), layout_from_config(cfg, world)


def _piped(layout, pp, vpp, m, schedule=None):
    """``layout`` as ``pp`` stages of ``vpp`` chunks running ``m`` microbatches (dp = 1)."""
    batch = m * layout.micro_batch_size
    return layout.with_(pp=pp, vpp=vpp, dp=1, global_batch_size=batch, pipeline_schedule=schedule)


def _times(spec, layout):
    """A chunk's forward, B and W per token as the model's FLOPs give them, B with recompute."""
    f, b, w = split_backward_times(spec)
    return f, b + recompute_flops_per_token(spec, layout), w


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_each_schedules_bubble_is_its_closed_form_or_its_simulation(recompute):
    spec, base = _tiny()
    base = base.with_(recompute=recompute)
    f, b, w = _times(spec, base)
    assert w < f < b  # unbalanced: ZBV's closed form is not exact here
    for pp in (2, 4, 8):
        for m in (pp, 2 * pp, 3 * pp, 5 * pp + 1):
            one = bubble(spec, _piped(base, pp, 1, m))
            assert one == analytic_bubble(pp, 1, m) == pytest.approx((pp - 1) / m)
            zb_h1 = bubble(spec, _piped(base, pp, 1, m, "zb-h1"))
            assert zb_h1 == analytic_bubble(pp, 1, m, "zb-h1", f, b + w, w)
            sim = simulate(pp, 1, m, f, b + w, schedule="zb-h1", weight_time=w)
            assert zb_h1 == pytest.approx(max(bubble_fraction(sim, r) for r in range(pp)))
            assert zb_h1 < one
            zbv = bubble(spec, _piped(base, pp, 2, m, "zbv"))
            sim = simulate(pp, 2, m, f, b + w, schedule="zbv", weight_time=w)
            assert zbv == pytest.approx(max(bubble_fraction(sim, r) for r in range(pp)), rel=1e-3)
            if m % pp == 0:
                interleaved = bubble(spec, _piped(base, pp, 2, m))
                assert interleaved == analytic_bubble(pp, 2, m) == pytest.approx((pp - 1) / (2 * m))
                # ZBV fills its V with 2 pp microbatches; with fewer it may idle more.
                assert zbv < interleaved or m < 2 * pp


def test_balanced_zbv_is_the_closed_form():
    spec, base = _tiny()
    lay = _piped(base, 4, 2, 12, "zbv")
    balanced = simulate(4, 2, 12, 1.0, 2.0, schedule="zbv", weight_time=1.0)
    assert analytic_bubble(4, 2, 12, "zbv", 1.0, 2.0, 1.0) == bubble_fraction(balanced, 0)
    assert bubble(spec, lay) != analytic_bubble(4, 2, 12, "zbv", 1.0, 2.0, 1.0)  # unbalanced


def _counts(pp, vpp):
    ones = dict.fromkeys(range(pp * vpp), 1)
    return ones, ones  # kept = sizes: the walk counts microbatch-chunks from F to W


def test_zb_h1_holds_1f1bs_peak_and_zbv_less_than_interleaved():
    for pp in (2, 3, 4, 8):
        m = 3 * pp
        sizes, kept = _counts(pp, 1)
        zb = [peak_in_flight(pp, 1, m, r, sizes, kept=kept, schedule="zb-h1") for r in range(pp)]
        plain = [peak_in_flight(pp, 1, m, r, sizes) for r in range(pp)]
        assert max(zb) == max(plain) == pp  # as many on the busiest rank as 1F1B
        sim = simulate(pp, 1, m, schedule="zb-h1")
        assert zb == [sim.max_in_flight[r] for r in range(pp)]
        sizes, kept = _counts(pp, 2)
        zbv = [peak_in_flight(pp, 2, m, r, sizes, kept=kept, schedule="zbv") for r in range(pp)]
        inter = [peak_in_flight(pp, 2, m, r, sizes) for r in range(pp)]
        assert zbv == [simulate(pp, 2, m, schedule="zbv").max_in_flight[r] for r in range(pp)]
        assert zbv == [2 * pp] * pp  # pp microbatches of the rank's whole part, as 1F1B's rank 0
        assert max(zbv) < max(inter) == 2 * pp + pp - 1  # pp (1 + (pp - 1) / (2 pp)) parts


def test_the_tensors_w_keeps_from_b_count():
    """pp = 2 under ZB-H1: the last stage defers its first W, so the second microbatch's
    forward runs beside the first one's W tensors: its peak is 1F1B's plus exactly those. The
    first stage holds the first chunk, whose B is its whole backward: its peak is 1F1B's."""
    spec, base = _tiny(["model.num_layers=4", "model.seq_length=64"])
    lay = _piped(base, 2, 1, 4)
    plain, split = (
        [s.activations for s in make_plan(spec, lay.with_(pipeline_schedule=x)).stages]
        for x in (None, "zb-h1")
    )
    blocks = moe.blocks_weight_grad_bytes(spec, lay, (False, False))
    kept = {1: blocks + dense.head_weight_grad_bytes(spec, lay)}
    sizes = {
        0: 2 * dense.layer_bytes(spec, lay) + dense.embedding_bytes(spec, lay),
        1: 2 * dense.layer_bytes(spec, lay) + dense.head_bytes(spec, lay),
    }
    assert plain[1].saved_peak == sizes[1] and plain[0].saved_peak == 2 * sizes[0]
    assert split[1].saved_peak - plain[1].saved_peak == kept[1] > 0
    assert split[0].saved_peak == plain[0].saved_peak


@pytest.mark.slow
def test_capped_microbatches_give_the_peak_of_more():
    rng = random.Random(0)
    for schedule, vpp in (("zb-h1", 1), ("zbv", 2)):
        for pp in range(2, 7):
            cap = capped_microbatches(_piped(_tiny()[1], pp, vpp, 100))
            n = pp * vpp
            sizes = {c: rng.randint(1, 100) for c in range(n)}
            kept = {c: rng.randint(1, 150) for c in range(n)}
            rebuilt = {c: rng.randint(0, 50) for c in range(n)}
            for r in range(pp):
                peaks = {
                    peak_in_flight(
                        pp, vpp, m, r, sizes, kept=kept, rebuilt=rebuilt, schedule=schedule
                    )
                    for m in range(cap, cap + 3 * pp)
                }
                assert len(peaks) == 1, (schedule, pp, r)
                early = {p2p_buffers(pp, vpp, m, r, schedule) for m in range(3 * pp, 6 * pp)}
                assert len(early) == 1, (schedule, pp, r)  # p2p_workspace walks 3 pp of them


def test_p2p_buffers_beside_a_compute_per_schedule():
    for pp in (2, 3, 4, 8):
        for r in range(pp):  # each compute waits for its group first: nothing beside it
            assert p2p_buffers(pp, 1, 2 * pp, r, "1f1b") == 0
            assert p2p_buffers(pp, 1, 2 * pp, r, "zb-h1") == 0
        # Early receives: the first rank's warm-up outputs stay in flight until its first
        # receive is due (the V's first rank sends up both legs); every rank holds a few,
        # however many microbatches.
        zbv = [p2p_buffers(pp, 2, m, r, "zbv") for m in (3 * pp, 5 * pp) for r in range(pp)]
        assert zbv[0] == 2 * (pp - 1) and max(zbv) <= 2 * pp and zbv[:pp] == zbv[pp:]
        interleaved = [
            p2p_buffers(pp, 2, m, r, "interleaved") for m in (3 * pp, 5 * pp) for r in range(pp)
        ]
        assert interleaved[0] == pp - 1 and max(interleaved) <= 2 * pp
        assert interleaved[:pp] == interleaved[pp:]  # 3 pp hold what more do


def test_zbv_turns_locally_and_holds_the_tied_embedding_on_stage_0():
    spec, base = _tiny(["model.arch=gpt2"])
    assert spec.tie_embeddings
    zbv, inter = _piped(base, 4, 2, 8, "zbv"), _piped(base, 4, 2, 8)
    calls = {r: pp_volume(spec, zbv, r)["pp/send"][0] for r in range(4)}
    assert calls == {0: 2 * 8, 1: 4 * 8, 2: 4 * 8, 3: 2 * 8}  # the ends: one neighbour each
    assert sum(calls.values()) == 2 * 8 * (2 * 4 - 2)  # one boundary fewer than interleaved
    assert sum(pp_volume(spec, inter, r)["pp/send"][0] for r in range(4)) == 2 * 8 * (8 - 1)
    assert exposed_messages(zbv) == exposed_messages(inter) - 2
    assert embedding_volume(spec, zbv, 0) == {} and embedding_volume(spec, inter, 0)
    head = make_plan(spec, zbv).stages
    assert head[0].states.params > head[1].states.params  # the embedding and the head


def test_representative_stages_of_zero_bubble_layouts_equal_make_plan():
    for recompute in ("none", "selective", "full"):
        for pp in (4, 8):
            spec, base = _tiny([f"trainer.recompute={recompute}"])
            for vpp, schedule in ((1, "zb-h1"), (2, "zbv")):
                lay = _piped(base, pp, vpp, 4 * pp, schedule)
                fast, full = Planner(spec).plan(lay, representative=True), make_plan(spec, lay)
                assert fast.peak_bytes == full.peak_bytes, lay.describe()
                for stage in fast.stages:
                    assert stage == full.stages[stage.pp_rank], lay.describe()


# -- against CPU runs ---------------------------------------------------------------------------

SHAPE = ["model.seq_length=64", "trainer.micro_batch_size=4", "trainer.global_batch_size=16"]
MEMORY_LAYOUTS = [
    (2, ["parallel.pp=2", "parallel.pipeline_schedule=zb-h1"]),
    (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_schedule=zbv"]),
    (2, ["parallel.pp=2", "parallel.pipeline_schedule=zb-h1", "trainer.recompute=full"]),
]


@pytest.mark.parametrize(
    "world,extra", MEMORY_LAYOUTS, ids=[" ".join(x) for _, x in MEMORY_LAYOUTS]
)
def test_planned_zero_bubble_memory_matches_measured(world, extra):
    overrides = SHAPE + extra
    results = measure_layout(world, overrides)
    cfg = tiny_config(overrides, 5)
    plan = make_plan(spec_of(cfg), layout_from_config(cfg, world))
    for pp_rank, measured in activations_by_stage(results).items():
        stage = plan.stages[pp_rank]
        ratio = stage.step_extra / measured
        assert 0.85 <= ratio <= 1.15, (pp_rank, stage.activations, measured, ratio)


def test_planned_zbv_messages_match_measured():
    extra = ["parallel.pp=4", "parallel.vpp=2", "parallel.pipeline_schedule=zbv"]
    extra += ["model.num_layers=8", "model.arch=gpt2"]  # tied: the embedding and head on rank 0
    results = run_world(train_layout, 4, extra, 1)
    cfg = tiny_config(extra, 1)
    plan = make_plan(spec_of(cfg), layout_from_config(cfg, 4))
    for rank, run in enumerate(results):
        measured = {k: (v["calls"], v["bytes"]) for k, v in run.stats.items()}
        measured = {k: v for k, v in measured.items() if not k.startswith(("world/", "mp/"))}
        assert measured == plan.stages[rank].comm, rank


# -- the advisor, the report --------------------------------------------------------------------


@pytest.fixture(scope="module")
def eight_layers():
    cfg = tiny_config(["model.num_layers=8", "trainer.global_batch_size=16"], 1)
    return cfg, spec_of(cfg)


def test_candidates_hold_every_valid_zero_bubble_schedule(eight_layers):
    cfg, _ = eight_layers
    layouts = valid_layouts(cfg, 8)
    listed = set(layouts)
    view = config_view(cfg)
    zero_bubble = [x for x in layouts if x.pipeline_schedule is not None]
    assert {(x.vpp, x.pipeline_schedule) for x in zero_bubble} == {(1, "zb-h1"), (2, "zbv")}
    for x in layouts:
        assert x.pipeline_schedule is None or x.pp > 1
        if x.pp > 1 and x.pipeline_schedule is None and x.vpp in ZERO_BUBBLE:
            sibling = x.with_(pipeline_schedule=ZERO_BUBBLE[x.vpp])
            assert layout_errors(view, sibling) == [] and sibling in listed, x.describe()
    for x in zero_bubble[::25]:
        assert layout_errors(view, x) == [], x.describe()
        explicit = x.with_(pipeline_schedule=DEFAULT[x.vpp])  # the default, named: refused
        assert explicit not in listed


@pytest.mark.slow
def test_advisor_picks_a_zero_bubble_schedule_where_it_is_faster_and_fits(eight_layers):
    cfg, spec = eight_layers
    roomy = advise(cfg, spec, 8, H100, 2**40, 0, top=10_000)
    by_layout = {r.layout: r for r in roomy.ranked}
    faster = 0
    for lay, r in by_layout.items():
        if lay.pp > 1 and lay.pipeline_schedule is None and lay.vpp in ZERO_BUBBLE:
            sibling = by_layout[lay.with_(pipeline_schedule=ZERO_BUBBLE[lay.vpp])]
            if lay.vpp == 1 or lay.num_microbatches >= 2 * lay.pp:  # ZBV's V filled
                assert sibling.time.bubble < r.time.bubble, lay.describe()
            faster += sibling.time.total < r.time.total
    assert faster > 0
    best = {r.shape: r.layout for r in roomy.best_of_each_shape()}
    assert any(x.pipeline_schedule for x in best.values())
    # Where the zero-bubble sibling does not fit, its default schedule is chosen instead.
    lay = next(x for x in by_layout if x.pp == 2 and x.vpp == 1 and x.pipeline_schedule is None)
    zb = by_layout[lay.with_(pipeline_schedule="zb-h1")]
    assert zb.plan.peak_bytes > by_layout[lay].plan.peak_bytes
    tight = advise(cfg, spec, 8, H100, by_layout[lay].plan.peak_bytes, 0, top=10_000)
    kept = {r.layout for r in tight.ranked}
    assert lay in kept and zb.layout not in kept


@pytest.mark.slow
def test_the_plan_and_the_advised_file_name_the_schedule(tmp_path, monkeypatch, capsys):
    args = ["+experiment=tiny", "world_size=2", "parallel.pp=2", "trainer.global_batch_size=32"]
    assert plan_main([*args, "parallel.pipeline_schedule=zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "schedule=zb-h1" in out and "(zb-h1 schedule)" in out
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "(1f1b schedule)" in out and "schedule=" not in out

    root = tmp_path / "configs"
    shutil.copytree(compose.CONFIG_DIR, root)
    monkeypatch.setattr(compose, "CONFIG_DIR", str(root))
    cfg = tiny_config(["model.num_layers=8"], 1)
    lay = layout_from_config(cfg, 8).with_(pp=4, vpp=2, dp=2, pipeline_schedule="zbv")
    path = root / "parallel" / "advised.yaml"
    command = write_parallel_file(path, lay, ["model.num_layers=8"], "test")
    assert "pipeline_schedule: zbv" in path.read_text() and "parallel=advised" in command
    assert load_config(["parallel=advised"]).parallel.pipeline_schedule == "zbv"
    # An experiment's own parallel keys win over a group file: explicit keys name it then.
    command = write_parallel_file(path, lay, ["+experiment=gpt_1b"], "test")
    assert "parallel.pipeline_schedule=zbv" in command
    ran = layout_from_config(load_config(command.split("   ")[0].split()[3:]), 8)
    assert (ran.pp, ran.vpp, ran.schedule) == (4, 2, "zbv")
    plain = lay.with_(pipeline_schedule=None)
    command = write_parallel_file(path, plain, ["parallel.pipeline_schedule=zbv"], "test")
    assert "pipeline_schedule" not in path.read_text()
    ran = layout_from_config(load_config(command.split("   ")[0].split()[3:]), 8)
    assert ran.schedule == "interleaved"


def test_step_time_of_a_zero_bubble_schedule_differs_only_in_bubble_and_transfers():
    cfg = load_config(["+experiment=gpt_1b", "model.vocab_size=32000"])
    spec = spec_of(cfg)
    base = layout_from_config(cfg, 64).with_(pp=4, dp=8)
    plain, split = (
        step_time(make_plan(spec, base.with_(pipeline_schedule=s)), H100) for s in (None, "zb-h1")
    )
    assert split.bubble < plain.bubble and split.compute == plain.compute and split.pp == plain.pp
