"""The layout advisor: valid candidates, the fast plans, the step-time model, ranking, the
written parallel file and the command line (pure: no processes)."""

import copy
import itertools
import math
import shutil

import pytest
from omegaconf import OmegaConf

from megatronish.config import compose
from megatronish.config.compose import load_config
from megatronish.config.validate import config_errors
from megatronish.plan.advisor import Ranked, advise, fit_phrase, reason
from megatronish.plan.candidates import (
    MICRO_BATCH_SIZES,
    base_errors,
    divisors,
    dp_variants,
    node_shard_size,
    valid_layouts,
)
from megatronish.plan.cli import main as plan_main
from megatronish.plan.estimate import Planner, make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.plan.matmul_efficiency import matmul_efficiency, model_efficiency
from megatronish.plan.pipeline import representative_stages
from megatronish.plan.report import write_parallel_file
from megatronish.plan.step_time import TERMS, Hardware, StepTime, lower_bound, step_time
from megatronish.testing.runs import test_config as tiny_config

GiB = 2**30
# Eight layers, so that pipelines of 2, 4 and 8 stages with interleaving are candidates.
EIGHT_LAYERS = ["model.num_layers=8", "trainer.global_batch_size=16"]
H100 = Hardware(peak_flops=989e12)


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config(EIGHT_LAYERS, 1)
    return cfg, spec_of(cfg)


@pytest.fixture(scope="module")
def tiny_layouts(tiny):
    return valid_layouts(tiny[0], 8)


def _real_config(cfg, layout):
    """A composed config with the layout's values, as a user would write them."""
    new = copy.deepcopy(cfg)
    for key, value in {
        "parallel.tp": layout.tp,
        "parallel.cp": layout.cp,
        "parallel.pp": layout.pp,
        "parallel.vpp": layout.vpp,
        "parallel.dp": None,
        "parallel.sp": layout.sp,
        "parallel.zero_stage": layout.zero_stage,
        "trainer.micro_batch_size": layout.micro_batch_size,
        "trainer.recompute": layout.recompute,
    }.items():
        OmegaConf.update(new, key, value, merge=False)
    return new


@pytest.mark.slow
def test_candidates_are_exactly_the_layouts_the_trainer_accepts():
    cfg = tiny_config([], 1)  # 4 layers, 8 heads / 4 kv heads, global batch 8
    layouts = valid_layouts(cfg, 4)
    shapes = {}
    for x in layouts:
        shapes.setdefault((x.tp, x.cp, x.pp, x.vpp, x.sp, x.micro_batch_size), x)
    for layout in shapes.values():
        assert config_errors(_real_config(cfg, layout), 4) == [], layout.describe()
    # Every shape left out breaks a rule (same search space: tp, cp and pp divide the world).
    base = layout_from_config(cfg, 1)
    for tp, cp, pp in itertools.product(divisors(4), repeat=3):
        if 4 % (tp * cp * pp):
            continue
        for vpp, mbs in itertools.product(range(1, 5), MICRO_BATCH_SIZES):
            for sp in (False, True) if tp > 1 else (False,):
                key = (tp, cp, pp, vpp, sp, mbs)
                if key in shapes or mbs * (4 // (tp * cp * pp)) > 8:
                    continue
                lay = base.with_(tp=tp, cp=cp, pp=pp, vpp=vpp, sp=sp, micro_batch_size=mbs)
                assert config_errors(_real_config(cfg, lay), 4), lay.describe()
    kinds = {(x.tp, x.pp, x.vpp) for x in layouts}
    assert {(2, 2, 1), (1, 2, 2), (4, 1, 1), (1, 4, 1)} <= kinds
    assert (1, 4, 2) not in kinds  # 4 layers cannot make 8 chunks
    assert {(2, 2), (4, 1)} <= {(x.cp, x.dp) for x in layouts}  # cp=2 and 4 (seq 16)
    assert {x.zero_stage for x in layouts if x.dp_cp == 1} == {0}
    assert {x.zero_stage for x in layouts if x.dp_cp > 1} == {0, 1, 2, 3}
    assert {x.recompute for x in layouts} == {"none", "selective", "full"}


def test_one_planner_tells_layouts_of_the_same_shape_apart():
    """Layouts that differ only in the cp exchange or the experts' dispatch order share no
    cached block: each plan of one planner, in turn, equals a fresh full plan."""
    moe = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.num_query_groups=4"]
    cfg = tiny_config([*moe, "trainer.global_batch_size=8"], 1)
    spec = spec_of(cfg)
    base = layout_from_config(cfg, 8).with_(tp=2, cp=4, dp=1, sp=True, ep=2)
    planner = Planner(spec)
    exchanges = (("all_gather", 1), ("a2a", 1), ("ring", 1), ("a2a_ring", 2))
    for (cp_type, a2a), order in itertools.product(exchanges, ("tp_first", "ep_first")):
        layout = base.with_(cp_comm_type=cp_type, cp_a2a_size=a2a, moe_dispatch_order=order)
        assert planner.plan(layout).stages == make_plan(spec, layout).stages, layout.describe()


@pytest.mark.slow
def test_representative_stages_of_one_planner_equal_make_plan(tiny, tiny_layouts):
    """One planner shares every building block across layouts and plans three stages; the
    peak and those stages equal a fresh full plan of each layout."""
    spec = tiny[1]
    planner = Planner(spec)
    for layout in tiny_layouts[::9]:
        fast, full = planner.plan(layout, representative=True), make_plan(spec, layout)
        assert fast.peak_bytes == full.peak_bytes, layout.describe()
        assert [s.pp_rank for s in fast.stages] == representative_stages(layout.pp)
        for stage in fast.stages:
            assert stage == full.stages[stage.pp_rank], layout.describe()
        assert (fast.bubble, fast.hardware_flops_per_step) == (
            full.bubble,
            full.hardware_flops_per_step,
        )


@pytest.mark.slow
def test_lower_bound_never_exceeds_the_step_time(tiny, tiny_layouts):
    spec = tiny[1]
    planner = Planner(spec)
    cpu = Hardware(peak_flops=5e10, intra_node_bw=2e9, inter_node_bw=2e9, shared_cores=2)
    for hw in (H100, cpu, Hardware(peak_flops=1e12, gpus_per_node=2, latency_s=1e-4)):
        for layout in tiny_layouts[::3]:
            total = step_time(planner.plan(layout, representative=True), hw).total
            bound = lower_bound(spec, layout, hw)
            assert bound <= total * (1 + 1e-12), layout.describe()
            # the advisor computes it once for every ZeRO stage of a layout
            assert bound == lower_bound(spec, layout.with_(zero_stage=0), hw), layout.describe()


def _time(spec, layout, hw=H100):
    return step_time(make_plan(spec, layout), hw)


def test_step_time_terms_follow_the_layout():
    cfg = load_config(["+experiment=gpt_1b", "model.vocab_size=32000"])
    spec = spec_of(cfg)
    base = layout_from_config(cfg, 8).with_(tp=1, sp=False, dp=8, zero_stage=0)
    plain = _time(spec, base)
    assert plain.tp == plain.bubble == plain.pp == plain.recompute == 0
    assert plain.total == pytest.approx(sum(plain.terms().values()))

    tp2, tp4 = (_time(spec, base.with_(tp=t, dp=8 // t)) for t in (2, 4))
    assert 0 < tp2.tp < tp4.tp
    across = _time(spec, base.with_(tp=4, dp=2), Hardware(peak_flops=989e12, gpus_per_node=2))
    assert across.tp > 5 * tp4.tp  # the tp group leaves the node: the network, not NVLink

    pp2, pp4 = (_time(spec, base.with_(pp=p, dp=8 // p)) for p in (2, 4))
    assert 0 < pp2.bubble < pp4.bubble and pp2.pp > 0
    interleaved = _time(spec, base.with_(pp=4, vpp=2, dp=2))
    assert interleaved.bubble < pp4.bubble
    assert pp2.compute > plain.compute  # the last stage also computes the head

    rc = {r: _time(spec, base.with_(recompute=r)).recompute for r in ("none", "selective", "full")}
    assert rc["none"] == 0 < rc["selective"] < rc["full"]

    zero3 = _time(spec, base.with_(zero_stage=3))
    assert zero3.dp > plain.dp  # parameter gathers before every forward and backward
    slow_net = _time(spec, base, Hardware(peak_flops=989e12, intra_node_bw=1e9))
    assert slow_net.dp > plain.dp  # grad reduction no longer hidden behind the backward


def test_matmul_efficiency_is_monotone_bounded_and_half_at_the_ridge():
    hw = Hardware(peak_flops=989e12, efficiency=0.6, memory_bw=3.35e12)
    ridge = 0.6 * 989e12 / 3.35e12
    sizes = [64, 256, 1024, 2048, 4096, 16384, 65536]
    for k, n in itertools.product(sizes, repeat=2):
        effs = [matmul_efficiency(m, k, n, 2, hw) for m in sizes]
        assert all(0 < e < 0.6 for e in effs) and effs == sorted(effs), (k, n)
        assert matmul_efficiency(4096, k, n, 4, hw) < matmul_efficiency(4096, k, n, 2, hw)
    # Half of the top at the ridge point: a square matmul of intensity m / 3 (2 bytes each).
    assert matmul_efficiency(3 * ridge, 3 * ridge, 3 * ridge, 2, hw) == pytest.approx(0.3)
    unbounded = Hardware(peak_flops=989e12, efficiency=0.6, memory_bw=math.inf)
    assert matmul_efficiency(1, 1, 1, 2, unbounded) == 0.6  # the flat model of old


def test_efficiency_rises_with_the_micro_batch_and_falls_with_tp_and_cp():
    cfg = load_config(["+experiment=gpt_1b", "model.vocab_size=32000"])
    spec = spec_of(cfg)
    base = layout_from_config(cfg, 8).with_(tp=1, sp=False, dp=8, zero_stage=1)
    by_mbs = [
        model_efficiency(spec, base.with_(micro_batch_size=b), H100) for b in MICRO_BATCH_SIZES
    ]
    assert by_mbs == sorted(by_mbs) and len(set(by_mbs)) == len(by_mbs)
    assert 0.8 * H100.efficiency < by_mbs[0] < by_mbs[-1] < H100.efficiency
    by_tp = [
        model_efficiency(spec, base.with_(tp=t, sp=t > 1, dp=8 // t), H100) for t in (1, 2, 4, 8)
    ]
    assert by_tp == sorted(by_tp, reverse=True) and len(set(by_tp)) == 4
    by_cp = [model_efficiency(spec, base.with_(cp=c, dp=8 // c), H100) for c in (1, 2, 4)]
    assert by_cp == sorted(by_cp, reverse=True) and len(set(by_cp)) == 3
    # Without a pipeline a larger micro batch is never slower (the same tokens per step);
    # in a pipeline fewer, larger microbatches widen the bubble while the compute shrinks.
    steps = [_time(spec, base.with_(micro_batch_size=b)).total for b in MICRO_BATCH_SIZES]
    assert steps == sorted(steps, reverse=True)
    piped = [_time(spec, base.with_(pp=4, dp=2, micro_batch_size=b)) for b in (1, 16)]
    assert piped[0].compute > piped[1].compute and piped[0].bubble < piped[1].bubble


@pytest.mark.slow
def test_the_advisor_takes_the_largest_micro_batch_that_fits():
    """gpt_1b on one node: with room, tp=1 micro batch 16 ranks first (the largest matmuls); a
    device too small for it gets micro batch 8 in the same shape."""
    cfg = load_config(["+experiment=gpt_1b", "model.vocab_size=32000"])
    spec = spec_of(cfg)
    planner = Planner(spec)
    roomy = advise(cfg, spec, 8, H100, 80 * GiB, int(1.5 * GiB), top=2, planner=planner)
    roomy = roomy.ranked[0].layout
    assert (roomy.tp, roomy.cp, roomy.pp, roomy.micro_batch_size) == (1, 1, 1, 16)
    # Too small for micro batch 16 without recompute at any ZeRO stage: micro batch 8 beats
    # micro batch 16 with recompute (its forward again costs more than the larger matmuls gain).
    peak = min(make_plan(spec, roomy.with_(zero_stage=z)).peak_bytes for z in range(4))
    small = advise(cfg, spec, 8, H100, peak - 1, 0, top=2, planner=planner)
    first = [r.layout for r in small.best_of_each_shape() if r.shape == (1, 1, 1, 1)][0]
    assert (first.micro_batch_size, first.recompute) == (8, "none")
    flat = Hardware(peak_flops=989e12, memory_bw=math.inf)  # one efficiency: sizes tie
    tied = [
        r
        for r in advise(cfg, spec, 8, flat, 80 * GiB, 0, top=2, planner=planner).ranked
        if r.shape == (1, 1, 1, 1)
    ]
    assert tied[0].layout.micro_batch_size == 1  # on a tie the smaller memory wins


def test_shared_cores_slow_every_rank_and_hide_the_bubble():
    cfg = tiny_config(EIGHT_LAYERS, 1)
    spec = spec_of(cfg)
    lay = layout_from_config(cfg, 4).with_(pp=2, dp=2)
    own = Hardware(peak_flops=1e10)
    shared = Hardware(peak_flops=1e10, shared_cores=2)
    t_own, t_shared = _time(spec, lay, own), _time(spec, lay, shared)
    assert t_shared.compute == pytest.approx(2 * t_own.compute)  # 4 ranks on 2 cores
    assert t_own.bubble > 0 and t_shared.bubble == 0  # 2 ranks per stage keep 2 cores busy


def _ranked(time: StepTime, **layout) -> Ranked:
    cfg = tiny_config([], 1)
    lay = layout_from_config(cfg, 4).with_(**layout)
    return Ranked.of(make_plan(spec_of(cfg), lay), time)


def test_reason_names_the_terms_that_win():
    zero = dict.fromkeys(TERMS, 0.0)
    win = _ranked(StepTime(**{**zero, "compute": 1.0, "tp": 0.1}), tp=2, dp=2, zero_stage=1)
    lose = _ranked(StepTime(**{**zero, "compute": 1.0, "tp": 0.5, "bubble": 0.6}), tp=4, dp=1, pp=1)
    hw = Hardware(peak_flops=1e12, gpus_per_node=2)
    assert reason(win, lose, hw) == "no bubble, tp inside a node, fits with zero 1"
    same = _ranked(StepTime(**{**zero, "compute": 1.0, "tp": 0.1}), tp=2, dp=2, zero_stage=2)
    assert reason(win, same, hw) == "as fast as the next, fits with zero 1"
    full = _ranked(StepTime(**zero), recompute="full", dp=4)
    assert reason(full, None, hw) == "fits with zero 0 and full recompute"
    hier = dict(cp=8, dp=1, cp_comm_type="a2a_ring", cp_a2a_size=4)
    a2a_ring = _ranked(StepTime(**{**zero, "compute": 1.0, "cp": 0.1}), **hier)
    a2a = _ranked(StepTime(**{**zero, "compute": 1.0, "cp": 0.2}), cp=8, dp=1, cp_comm_type="a2a")
    assert reason(a2a_ring, a2a, hw) == (
        "less exposed cp communication (a2a_ring/4), fits with zero 0"
    )
    hybrid = _ranked(StepTime(**{**zero, "compute": 1.0}), dp=8, zero_stage=1, zero_shard_size=2)
    across = _ranked(StepTime(**{**zero, "compute": 1.0, "dp": 0.3}), dp=8, zero_stage=1)
    assert reason(hybrid, across, hw) == (
        "less exposed dp communication (ZeRO inside a node), fits with zero 1 over 2 dp ranks"
    )
    powersgd = _ranked(
        StepTime(**{**zero, "compute": 1.0}), dp=4, grad_compression="powersgd", powersgd_rank=8
    )
    plain = _ranked(StepTime(**{**zero, "compute": 1.0, "dp": 0.3}), dp=4)
    assert reason(powersgd, plain, hw) == (
        "less exposed dp communication (powersgd/8 compression, lossy), fits with zero 0"
    )


@pytest.mark.slow
def test_advisor_ranks_what_fits_by_the_model(tiny):
    cfg, spec = tiny
    planner = Planner(spec)  # the three calls plan the same layouts
    roomy = advise(cfg, spec, 8, H100, 2**40, 0, top=10_000, planner=planner)  # all fit
    assert roomy.planned == roomy.valid == len(roomy.ranked) and roomy.too_big == 0
    peaks = sorted(r.plan.peak_bytes for r in roomy.ranked)
    limit = peaks[len(peaks) // 2]
    tight = advise(cfg, spec, 8, H100, limit, 0, top=10_000, planner=planner)
    assert tight.too_big > 0 and len(tight.ranked) + tight.too_big == tight.valid
    for advice in (roomy, tight):
        totals = [r.time.total for r in advice.ranked]
        assert totals == sorted(totals)
    assert all(r.plan.peak_bytes <= limit for r in tight.ranked)
    best = tight.ranked[0]
    again = step_time(make_plan(spec, best.layout), H100)  # the full plan agrees
    assert again.total == pytest.approx(best.time.total, rel=1e-12)
    # Planning fewer layouts (a top of 3) does not change the top of the full ranking.
    top3 = advise(cfg, spec, 8, H100, limit, 0, top=3, planner=planner)
    assert top3.planned < top3.valid
    firsts = [r.layout for r in tight.best_of_each_shape()[:4]]
    assert [r.layout for r in top3.best_of_each_shape()[:4]] == firsts


@pytest.fixture
def config_copy(tmp_path, monkeypatch):
    """A copy of configs/ that load_config reads (written group files stay in tmp_path)."""
    root = tmp_path / "configs"
    shutil.copytree(compose.CONFIG_DIR, root)
    monkeypatch.setattr(compose, "CONFIG_DIR", str(root))
    return root


def test_written_parallel_file_composes(config_copy, tiny):
    layout = layout_from_config(tiny[0], 8).with_(
        tp=2, pp=2, vpp=2, dp=2, sp=True, zero_stage=1, micro_batch_size=2, recompute="full"
    )
    path = config_copy / "parallel" / "advised.yaml"
    command = write_parallel_file(path, layout, ["model.num_layers=8", "parallel.tp=4"], "test")
    assert "parallel=advised" in command and "parallel.tp=4" not in command
    assert "trainer.micro_batch_size=2 trainer.recompute=full" in command
    cfg = load_config(["parallel=advised"])
    p = cfg.parallel
    assert (p.tp, p.pp, p.vpp, p.dp, p.sp, p.zero_stage) == (2, 2, 2, None, True, 1)
    assert "trainer.micro_batch_size=2" in path.read_text()  # the trainer keys, in the header
    # An experiment that sets parallel keys itself wins over a group file: explicit keys then.
    command = write_parallel_file(path, layout, ["+experiment=gpt_1b"], "test")
    assert "parallel=advised" not in command and "parallel.tp=2" in command
    ran = layout_from_config(load_config(command.split("   ")[0].split()[3:]), 8)
    fields = ("tp", "pp", "vpp", "dp", "sp", "zero_stage", "micro_batch_size", "recompute")
    assert [getattr(ran, f) for f in fields] == [getattr(layout, f) for f in fields]


def test_an_advised_a2a_ring_layout_runs_as_written(config_copy, tiny):
    """The group file and the explicit command carry the exchange and its group size."""
    layout = layout_from_config(tiny[0], 8).with_(
        cp=4, dp=2, cp_comm_type="a2a_ring", cp_a2a_size=2, zero_stage=1
    )
    path = config_copy / "parallel" / "advised.yaml"
    command = write_parallel_file(path, layout, ["model.num_layers=8"], "test")
    assert "parallel=advised" in command
    p = load_config(["parallel=advised"]).parallel
    assert (p.cp, p.cp_comm_type, p.cp_a2a_size) == (4, "a2a_ring", 2)
    command = write_parallel_file(path, layout, ["+experiment=gpt_1b"], "test")
    assert "parallel.cp_a2a_size=2" in command
    ran = layout_from_config(load_config(command.split("   ")[0].split()[3:]), 8)
    assert (ran.cp, ran.cp_comm_type, ran.cp_a2a_size) == (4, "a2a_ring", 2)


GPT_1B = ["+experiment=gpt_1b", "model.vocab_size=32000", "world_size=8", "peak_tflops=989"]


def test_cli_prints_the_table_and_writes_the_layout(config_copy, capsys):
    out_file = config_copy / "parallel" / "advised.yaml"
    args = [*GPT_1B, "device_memory_gb=80", "advise=true", "top=3", f"advise_out={out_file}"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "tp=" in line]
    assert len(rows) == 3 and rows[0].startswith("| 1 ")
    assert "fits with zero" in rows[0] and "valid layouts" in out
    assert "run it with:" in out and out_file.exists()
    tiny_job = ["+experiment=tiny", "world_size=2", "peak_tflops=1", "advise=true"]
    assert plan_main([*tiny_job, "device_memory_gb=0.01"]) == 1
    assert "none of the" in capsys.readouterr().err


def test_cli_rejects_bad_advisor_options(capsys):
    assert plan_main(["+experiment=gpt_1b", "advise=true", "peak_tflops=989"]) == 2
    assert "world_size=N" in capsys.readouterr().err
    assert plan_main([*GPT_1B, "top=3"]) == 2
    assert "add advise=true" in capsys.readouterr().err
    assert plan_main([*GPT_1B, "advise=true", "efficiency=2", "device_memory_gb=80"]) == 2
    assert "efficiency=2.0" in capsys.readouterr().err
    assert plan_main([*GPT_1B, "advise=true", "top=ten"]) == 2
    assert "top=ten: expected a whole number" in capsys.readouterr().err


def test_long_sequences_are_advised_context_parallelism():
    """When no layout without cp fits a long sequence's activations, the advisor ranks cp
    layouts (and only those); with room for everything, the fastest has no cp traffic."""
    cfg = tiny_config(
        ["model.seq_length=4096", "trainer.micro_batch_size=1", "trainer.global_batch_size=4"], 1
    )
    spec = spec_of(cfg)
    planner = Planner(spec)
    without_cp = [x for x in valid_layouts(cfg, 4) if x.cp == 1]
    least = min(planner.plan(x, representative=True).peak_bytes for x in without_cp)
    tight = advise(cfg, spec, 4, H100, device_bytes=least - 1, runtime_bytes=0)
    assert tight.ranked and all(r.layout.cp > 1 for r in tight.ranked)
    assert tight.ranked[0].time.cp > 0
    roomy = advise(cfg, spec, 4, H100, device_bytes=2**40, runtime_bytes=0)
    assert roomy.ranked[0].time.cp == 0


def test_hybrid_sharding_candidates_shard_inside_a_node():
    """With nodes of ``gpus_per_node``, a ZeRO stage whose dp x cp group spans nodes is also
    a candidate sharded over the dp ranks of one node; never without ZeRO or inside a node."""
    base = layout_from_config(tiny_config([], 1), 1)
    assert node_shard_size(base.with_(tp=2, dp=32), 8) == 4
    assert node_shard_size(base.with_(tp=4, cp=2, dp=8), 8) == 1  # the cp ranks of a node
    assert node_shard_size(base.with_(tp=2, dp=4), 8) is None  # dp x cp inside one node
    assert node_shard_size(base.with_(tp=16, dp=4), 8) is None  # tp spans nodes
    assert node_shard_size(base.with_(tp=3, dp=8), 8) is None  # nodes split a tp group
    assert node_shard_size(base.with_(tp=2, dp=32), None) is None
    cfg = tiny_config(EIGHT_LAYERS, 1)
    layouts = valid_layouts(cfg, 8, gpus_per_node=2)
    hybrid = [x for x in layouts if x.zero_shard_size is not None]
    assert hybrid and all(x.zero_stage > 0 and x.tp * x.cp * x.zero_shard_size == 2 for x in hybrid)
    assert {x.with_(zero_shard_size=None) for x in hybrid} <= set(layouts)
    assert not any(x.zero_shard_size for x in valid_layouts(cfg, 8))


def test_layouts_across_nodes_are_also_candidates_with_compression():
    base = layout_from_config(tiny_config([], 1), 1).with_(tp=2, dp=32)
    assert dp_variants(base, 0, 8) == [{}, {"grad_compression": "powersgd", "powersgd_rank": 4}]
    assert dp_variants(base, 1, 8) == [
        {},
        {"zero_shard_size": 4},
        {"grad_compression": "powersgd", "powersgd_rank": 4},
        {"grad_compression": "int8"},
    ]
    assert dp_variants(base, 3, 8) == [{}, {"zero_shard_size": 4}, {"grad_compression": "int8"}]
    assert dp_variants(base.with_(dp=4), 1, 8) == [{}]  # one node: nothing crosses a slow link
    layouts = valid_layouts(tiny_config(EIGHT_LAYERS, 1), 8, gpus_per_node=2)
    kinds = {(x.zero_stage, x.grad_compression) for x in layouts if x.grad_compression}
    assert kinds == {(0, "powersgd"), (1, "powersgd"), (1, "int8"), (2, "int8"), (3, "int8")}


def test_the_configs_compression_keys_do_not_refuse_the_candidates():
    """A config that compresses from step 10 with the vocabulary: every candidate shape is
    checked uncompressed (its variants add the compression), so the keys that tune the
    config's own compression must not make the shapes invalid."""
    tuned = ["parallel.zero_stage=1", "parallel.grad_compression=powersgd"]
    tuned += ["parallel.grad_compression_start_step=10", "parallel.powersgd_compress_vocab=true"]
    cfg = tiny_config([*EIGHT_LAYERS, *tuned], 1)
    assert config_errors(cfg, 2, data=False) == []
    assert base_errors(cfg) == []
    assert len(valid_layouts(cfg, 8)) == len(valid_layouts(tiny_config(EIGHT_LAYERS, 1), 8))


GPT_1B_MB8 = ["+experiment=gpt_1b", "model.vocab_size=32000", "trainer.micro_batch_size=8"]


def test_compression_pays_over_ethernet_and_not_over_infiniband():
    """gpt_1b, dp 64 on 8 nodes, ZeRO 0: PowerSGD sends 9x fewer bytes (hundreds of times
    fewer with the vocabulary's matrices compressed too), which saves most of the step over
    100 Gb/s and costs its memory traffic over 400 Gb/s."""
    cfg = load_config(GPT_1B_MB8)
    spec = spec_of(cfg)
    plain = layout_from_config(cfg, 64).with_(tp=1, pp=1, vpp=1, dp=64, zero_stage=0)
    compressed = plain.with_(grad_compression="powersgd")
    with_vocab = compressed.with_(powersgd_compress_vocab=True)
    plans = [make_plan(spec, x) for x in (plain, compressed)]
    sent = [p.stages[0].comm["dp/all_reduce"][1] for p in plans]
    assert 8 * sent[1] < sent[0] < 10 * sent[1]
    assert sent[0] > 100 * make_plan(spec, with_vocab).stages[0].comm["dp/all_reduce"][1]
    ethernet, infiniband = (
        Hardware(peak_flops=989e12, inter_node_bw=g * 1e9 / 8) for g in (100, 400)
    )
    slow = [step_time(p, ethernet).total for p in plans]
    fast = [step_time(p, infiniband).total for p in plans]
    assert slow[1] < 0.5 * slow[0] and fast[0] < fast[1]
    assert plans[1].stages[0].compression_traffic > 0
    assert plans[1].stages[0].states.compression > 0 and plans[0].stages[0].states.compression == 0


GPT_7B = ["+experiment=gpt_7b", "model.vocab_size=32000", "trainer.micro_batch_size=2"]


@pytest.mark.parametrize("zero", [1, 3])
def test_hybrid_sharding_pays_over_ethernet_and_costs_memory(zero):
    """gpt_7b on 64 H100s (8 nodes), dp 64: over 100 Gb/s Ethernet plain ZeRO waits seconds
    for its reductions and gathers across nodes; shard groups of a node move the full volume
    over NVLink and only each shard across nodes, hidden behind the backward. Over 400 Gb/s
    InfiniBand the two are within a percent. Hybrid sharding holds 8x the optimizer state."""
    cfg = load_config(GPT_7B)
    spec = spec_of(cfg)
    plain = layout_from_config(cfg, 64).with_(tp=1, pp=1, vpp=1, dp=64, zero_stage=zero)
    hybrid = plain.with_(zero_shard_size=8)
    plans = [make_plan(spec, x) for x in (plain, hybrid)]
    ethernet, infiniband = (
        Hardware(peak_flops=989e12, inter_node_bw=g * 1e9 / 8) for g in (100, 400)
    )
    slow = [step_time(p, ethernet) for p in plans]
    assert slow[0].dp > 1.0 and slow[1].dp < 0.05 * slow[0].dp
    fast = [step_time(p, infiniband).total for p in plans]
    assert fast[1] <= fast[0] < 1.03 * fast[1]
    optimizer = [p.stages[0].states.optimizer for p in plans]
    assert optimizer[1] == pytest.approx(8 * optimizer[0], rel=0.01)


def test_an_advised_compressed_layout_runs_as_written(config_copy, tiny):
    layout = layout_from_config(tiny[0], 8).with_(
        dp=8, zero_stage=1, grad_compression="powersgd", powersgd_rank=8
    )
    path = config_copy / "parallel" / "advised.yaml"
    write_parallel_file(path, layout, ["model.num_layers=8"], "test")
    p = load_config(["parallel=advised"]).parallel
    assert (p.grad_compression, p.powersgd_rank) == ("powersgd", 8)
    command = write_parallel_file(path, layout, ["+experiment=gpt_1b"], "test")
    ran = layout_from_config(load_config(command.split("   ")[0].split()[3:]), 8)
    assert (ran.grad_compression, ran.powersgd_rank) == ("powersgd", 8)


def test_an_advised_hybrid_layout_runs_as_written(config_copy, tiny):
    layout = layout_from_config(tiny[0], 8).with_(dp=8, zero_stage=3, zero_shard_size=2)
    path = config_copy / "parallel" / "advised.yaml"
    write_parallel_file(path, layout, ["model.num_layers=8"], "test")
    p = load_config(["parallel=advised"]).parallel
    assert (p.zero_stage, p.zero_shard_size) == (3, 2)
    command = write_parallel_file(path, layout, ["+experiment=gpt_1b"], "test")
    assert "parallel.zero_shard_size=2" in command
    ran = layout_from_config(load_config(command.split("   ")[0].split()[3:]), 8)
    assert (ran.zero_stage, ran.zero_shard_size) == (3, 2)
    plain = layout.with_(zero_shard_size=None)  # the user's own zero_shard_size is replaced
    command = write_parallel_file(path, plain, ["parallel.zero_shard_size=2"], "test")
    assert "zero_shard_size" not in command
    assert load_config(["parallel=advised"]).parallel.zero_shard_size is None


def test_the_advisor_offloads_the_optimizer_only_when_nothing_fits_without():
    cfg = tiny_config(["trainer.global_batch_size=4"], 1)
    spec = spec_of(cfg)
    planner = Planner(spec)
    layouts = valid_layouts(cfg, 2)
    plain = min(planner.plan(x, representative=True).peak_bytes for x in layouts)
    offloaded = [x.with_(optimizer_offload=True) for x in layouts]
    least = min(planner.plan(x, representative=True).peak_bytes for x in offloaded)
    assert least < plain
    tight = advise(cfg, spec, 2, H100, device_bytes=plain - 1, runtime_bytes=0, planner=planner)
    assert tight.offloaded and tight.ranked
    assert all(r.layout.optimizer_offload for r in tight.ranked)
    assert "the optimizer on the host" in fit_phrase(tight.ranked[0])
    roomy = advise(cfg, spec, 2, H100, device_bytes=2**40, runtime_bytes=0, planner=planner)
    assert not roomy.offloaded and not any(r.layout.optimizer_offload for r in roomy.ranked)


def test_offload_fits_gpt_7b_on_two_gpus_without_recompute():
    """gpt_7b, dp 2, ZeRO 3, micro batch 1 on 80 GB: without recompute the optimizer state
    is what does not fit; offloaded it fits and beats full recompute's step."""
    cfg = load_config(["+experiment=gpt_7b", "model.vocab_size=32000"])
    spec = spec_of(cfg)
    base = layout_from_config(cfg, 8).with_(
        tp=1, pp=1, vpp=1, dp=2, zero_stage=3, micro_batch_size=1, recompute="none"
    )
    device, runtime = 79 * GiB, int(1.5 * GiB)
    plain, offloaded = (make_plan(spec, base.with_(optimizer_offload=o)) for o in (False, True))
    recomputed = make_plan(spec, base.with_(recompute="full"))
    assert not plain.fits(device, runtime) and offloaded.fits(device, runtime)
    assert recomputed.fits(device, runtime)
    times = [step_time(p, H100).total for p in (plain, offloaded, recomputed)]
    assert times[0] < times[1] < times[2]
    assert offloaded.stages[0].states.host > 50 * GiB  # what the host holds instead
