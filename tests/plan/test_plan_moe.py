"""The planner and the advisor on mixture-of-experts models: active and total parameters, expert
memory per rank, the all-to-all and the other collectives of MoE blocks (against CommStats), the
activations they keep (against measured runs), and the advice of expert parallelism."""

from dataclasses import replace

import pytest

from megatronish.config.compose import load_config
from megatronish.config.validate import config_errors
from megatronish.model.build import build_chunks
from megatronish.model.flops import (
    active_parameters,
    count_parameters,
    flops_per_token,
    matmul_params,
)
from megatronish.model.parallel_context import ParallelContext
from megatronish.plan.advisor import advise
from megatronish.plan.candidates import expert_parallel_sizes, valid_layouts
from megatronish.plan.cli import main as plan_main
from megatronish.plan.estimate import Planner, make_plan
from megatronish.plan.fit_check import fitting_options
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.plan.moe import rank_blocks
from megatronish.plan.step_time import Hardware, lower_bound, step_time
from megatronish.spec import ModelSpec, MoESpec
from megatronish.testing.memory import activations_by_stage, measure_layout
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import test_config as tiny_config
from megatronish.testing.runs import train_layout

# Four experts of 32 hidden units, top-2, in every block of the tiny test model.
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=32"]
H100 = Hardware(peak_flops=989e12)


def _spec(arch: str) -> ModelSpec:
    """Two blocks (block 0 a mixture of 4 experts of 32 units + one shared, block 1 dense)."""
    llama = arch == "llama"
    return ModelSpec(
        arch=arch,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2 if llama else 4,
        ffn_hidden_size=96,
        seq_length=16,
        vocab_size=300,
        padded_vocab_size=384,
        max_position_embeddings=16,
        bias=not llama,
        tie_embeddings=not llama,
        moe=MoESpec(num_experts=4, top_k=2, layer_freq=2, ffn_hidden_size=32, shared_experts=1),
    )


@pytest.mark.parametrize(
    "arch,matmul,total,active",
    [
        # llama: attention 64*(4+2*2)*16 + 4*16*64 = 12288; the MoE block adds the router 4*64,
        # two (active) or four experts and the shared one of 3*64*32 = 6144 each; the dense
        # block an MLP of 3*64*96; head 384*64. Total: + norms 5*64, embedding 384*64.
        ("llama", 12288 + 256 + 3 * 6144 + 12288 + 18432 + 24576, 123456, 123456 - 2 * 6144),
        # gpt2: attention 64*12*16 + 4096 = 16384, experts 2*64*32 = 4096, MLP 2*64*96;
        # biases 256 (attention) and 160 (the dense MLP; experts have none), norms 5*128,
        # positions 16*64, a tied embedding.
        ("gpt2", 16384 + 256 + 3 * 4096 + 16384 + 12288 + 24576, 92704, 92704 - 2 * 4096),
    ],
)
def test_flops_count_active_parameters_and_the_total_counts_every_expert(
    arch, matmul, total, active
):
    spec = _spec(arch)
    assert matmul_params(spec) == matmul
    assert flops_per_token(spec) == 6 * matmul + 12 * 2 * 16 * 64
    assert count_parameters(spec) == total
    assert active_parameters(spec) == active
    [model] = build_chunks(spec, ParallelContext(), [2])
    assert sum(p.numel() for p in model.parameters()) == total


@pytest.mark.slow
def test_expert_parallel_candidates_divide_dp_cp_and_the_experts():
    assert expert_parallel_sizes(0, 8) == [1]
    assert expert_parallel_sizes(8, 4) == [1, 2, 4]
    assert expert_parallel_sizes(6, 8) == [1, 2]
    cfg = tiny_config(MOE, 1)
    layouts = valid_layouts(cfg, 4)
    assert {x.ep for x in layouts} == {1, 2, 4}
    assert all(x.dp_cp % x.ep == 0 for x in layouts)
    assert all(x.sequence_parallel for x in layouts if x.tp > 1)  # MoE with tp needs sp
    for x in {(x.tp, x.cp, x.pp, x.ep): x for x in layouts}.values():
        p = {"tp": x.tp, "cp": x.cp, "pp": x.pp, "ep": x.ep, "sp": x.sp}
        new = tiny_config([*MOE, *(f"parallel.{k}={str(v).lower()}" for k, v in p.items())], 1)
        assert config_errors(new, 4) == [], x.describe()


def test_recompute_reruns_moe_blocks_and_groups_ending_in_one():
    cfg = tiny_config([*MOE, "model.moe.layer_freq=2"], 1)  # blocks 0 and 2 of 4
    spec, base = spec_of(cfg), layout_from_config(cfg, 1)
    assert rank_blocks(spec, base, 0).moe == 2 and rank_blocks(spec, base, 0).redo == 0
    full = rank_blocks(spec, base.with_(recompute="full"), 0)
    assert (full.redo, full.moe_ending_groups) == (2, 2)
    pairs = rank_blocks(spec, base.with_(recompute="full", recompute_num_layers=2), 0)
    assert (pairs.redo, pairs.moe_ending_groups) == (2, 0)  # groups (0, 1) and (2, 3)
    block = base.with_(recompute="full", recompute_method="block", recompute_num_layers=1)
    assert (rank_blocks(spec, block, 0).redo, rank_blocks(spec, block, 0).moe_ending_groups) == (
        1,
        1,
    )


def test_experts_split_over_ep_and_shard_over_edp():
    cfg = tiny_config([*MOE, "model.moe.num_experts=8", "trainer.global_batch_size=16"], 1)
    spec, base = spec_of(cfg), layout_from_config(cfg, 8).with_(zero_stage=1)
    states = {ep: make_plan(spec, base.with_(ep=ep)).stages[0].states for ep in (1, 2, 4, 8)}
    experts = 4 * 8 * 3 * 64 * 32  # blocks x experts x an expert's weights
    assert states[1].param_numel - states[2].param_numel == experts // 2
    assert states[2].experts > states[4].experts > states[8].experts > 0
    # ep = 8 leaves each expert on one rank (edp = 1): nothing shards its moments any more.
    assert states[8].experts == pytest.approx(16 * experts // 8, rel=0.01)
    plan = make_plan(spec, base.with_(ep=2))
    assert set(plan.stages[0].comm) == {
        "dp/reduce_scatter",
        "dp/all_gather",
        "edp/all_gather",
        "edp/reduce_scatter",
        "ep/all_to_all",
    }


COMM_LAYOUTS = [
    (2, ["parallel.ep=2", "trainer.recompute=full"]),
    (4, ["parallel.ep=2", "parallel.zero_stage=2", "trainer.global_batch_size=8"]),
    (
        4,
        [
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.ep=2",
            "model.moe.shared_experts=1",
            "trainer.recompute=full",
        ],
    ),
    (
        4,
        [
            "parallel.cp=2",
            "parallel.ep=2",
            "parallel.zero_stage=3",
            "trainer.precision=bf16",
            "model.arch=gpt2",
        ],
    ),
    (
        4,
        [
            "parallel.pp=2",
            "parallel.ep=2",
            "model.moe.layer_freq=2",
            "parallel.zero_stage=1",
            "trainer.global_batch_size=8",
        ],
    ),
    (
        4,
        [
            "parallel.tp=2",
            "parallel.sp=true",
            "model.moe.layer_freq=2",
            "parallel.zero_stage=1",
            "trainer.recompute=full",
            "trainer.recompute_method=block",
            "trainer.recompute_num_layers=2",
        ],
    ),
    # hybrid sharding: dense buckets in shard groups of 2 dp ranks with their replica
    # all-reduce, the experts sharded over their own group (all 4 dp ranks; 2 under ep 2)
    (4, ["parallel.zero_stage=1", "parallel.zero_shard_size=2", "trainer.global_batch_size=8"]),
    (
        4,
        [
            "parallel.ep=2",
            "parallel.zero_stage=3",
            "parallel.zero_shard_size=2",
            "trainer.global_batch_size=8",
        ],
    ),
    # int8 compression of the dense and the expert reductions (each over its own group)
    (
        4,
        [
            "parallel.ep=2",
            "parallel.zero_stage=1",
            "parallel.grad_compression=int8",
            "trainer.global_batch_size=8",
        ],
    ),
    # Megatron-LM's order: the all-to-all of each tp rank's own tokens, then the rows gathered
    (
        4,
        [
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.ep=2",
            "parallel.moe_dispatch_order=ep_first",
            "model.moe.shared_experts=1",
            "trainer.recompute=full",
        ],
    ),
    (
        4,
        [
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.pp=2",
            "parallel.moe_dispatch_order=ep_first",
            "model.moe.layer_freq=2",
            "trainer.recompute=full",
            "trainer.recompute_method=block",
            "trainer.recompute_num_layers=2",
        ],
    ),
]


@pytest.mark.parametrize("world,extra", COMM_LAYOUTS, ids=[" ".join(x) for _, x in COMM_LAYOUTS])
def test_planned_moe_communication_matches_commstats(world, extra):
    """Every collective call for call and byte for byte; the all-to-all's bytes follow the
    routing (a rank sends ``T k`` rows, it receives what its experts got), so the plan's mean
    per rank times the ranks of a stage equals their sum; so do the tp gathers and
    reduce-scatters of received rows in Megatron-LM's order (``ep_first``)."""
    overrides = [*MOE, "trainer.global_batch_size=4", *extra]
    results = run_world(train_layout, world, overrides, 1)
    cfg = tiny_config(overrides, 1)
    plan = make_plan(spec_of(cfg), layout_from_config(cfg, world))
    lay = plan.layout
    per_stage = world // lay.pp
    sent: dict[int, int] = {}
    for rank, run in enumerate(results):
        stage = plan.stages[rank // per_stage]
        measured = {k: (v["calls"], v["bytes"]) for k, v in run.stats.items()}
        measured = {k: v for k, v in measured.items() if not k.startswith(("world/", "mp/"))}
        group = "dp_cp" if lay.cp > 1 else "dp"  # the loss (one fp32) on the last stage
        if rank // per_stage == lay.pp - 1 and lay.dp_cp > 1:
            calls, nbytes = measured.pop(f"{group}/all_reduce")
            if calls > 1:
                measured[f"{group}/all_reduce"] = (calls - 1, nbytes - 4)
        routed = ["ep/all_to_all"] * (lay.ep > 1)
        if lay.moe_dispatch_order == "ep_first":  # every stage has a mixture-of-experts block
            routed += ["tp/all_gather", "tp/reduce_scatter"]
        for key in routed:
            calls, nbytes = measured.pop(key)
            assert calls == stage.comm[key][0], (rank, key)
            sent[stage.pp_rank, key] = sent.get((stage.pp_rank, key), 0) + nbytes
        planned = {k: v for k, v in stage.comm.items() if k not in routed}
        assert measured == planned, rank
    for (pp_rank, key), nbytes in sent.items():
        assert nbytes == per_stage * plan.stages[pp_rank].comm[key][1], key


# seq 64, micro batch 4: activations dominate, as in tests/plan/test_plan.py.
SHAPE = ["model.seq_length=64", "trainer.micro_batch_size=4", "trainer.global_batch_size=16"]
MEMORY_LAYOUTS = [
    (1, ["model.moe.ffn_hidden_size=64"]),
    # ep runs in 4-rank worlds, as tp runs in tests/plan/test_plan.py: in a 2-rank one gloo's threads
    # free the all-to-all's buffers late by varying amounts.
    (4, ["parallel.ep=2", "model.arch=gpt2", "parallel.zero_stage=1"]),
    (4, ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2", "trainer.precision=bf16"]),
    # Megatron-LM's order: each tp rank routes and combines its own tokens' rows only
    (
        4,
        [
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.ep=2",
            "parallel.moe_dispatch_order=ep_first",
        ],
    ),
    (
        2,
        [
            "parallel.pp=2",
            "model.moe.layer_freq=2",
            "model.moe.shared_experts=1",
            "trainer.recompute=full",
        ],
    ),
]


@pytest.mark.parametrize(
    "world,extra",
    # the one-process case: ~6 s (the rest start processes)
    [
        pytest.param(w, x, marks=pytest.mark.slow)
        if x == ["model.moe.ffn_hidden_size=64"]
        else (w, x)
        for w, x in MEMORY_LAYOUTS
    ],
    ids=[" ".join(x) for _, x in MEMORY_LAYOUTS],
)
def test_planned_moe_memory_matches_measured(world, extra):
    """States exactly (experts split over ep, sharded over edp); the activation peak within
    the 15% tests/plan/test_plan.py allows dense models (the lower median of a stage's ranks: the
    rows an expert computes follow the routing)."""
    overrides = [*SHAPE, *MOE, *extra]
    results = measure_layout(world, overrides)
    cfg = tiny_config(overrides, 5)
    plan = make_plan(spec_of(cfg), layout_from_config(cfg, world))
    for pp_rank, measured, _ in results:
        stage = plan.stages[pp_rank]
        for kind in ("params", "grads", "optimizer"):
            assert getattr(stage.states, kind) == getattr(measured, kind), (pp_rank, kind)
    for pp_rank, measured in activations_by_stage(results).items():
        ratio = plan.stages[pp_rank].step_extra / measured
        assert 0.85 <= ratio <= 1.15, (pp_rank, ratio)


@pytest.mark.slow
def test_the_advisor_advises_ep_when_the_experts_do_not_fit_without_it():
    """Sixteen experts of 1024 units: below the smallest peak of any layout without expert
    parallelism only ep > 1 fits (and the all-to-all shows in its step time); with room for
    everything the fastest layout has none."""
    cfg = tiny_config(
        [
            *MOE,
            "model.moe.num_experts=16",
            "model.moe.ffn_hidden_size=1024",
            "trainer.global_batch_size=16",
        ],
        1,
    )
    spec = spec_of(cfg)
    planner = Planner(spec)
    without_ep = [x for x in valid_layouts(cfg, 4) if x.ep == 1]
    least = min(planner.plan(x, representative=True).peak_bytes for x in without_ep)
    tight = advise(cfg, spec, 4, H100, device_bytes=least - 1, runtime_bytes=0)
    assert tight.ranked and all(r.layout.ep > 1 for r in tight.ranked)
    assert tight.ranked[0].time.ep > 0 and "ep=" in tight.ranked[0].layout.describe()
    roomy = advise(cfg, spec, 4, H100, device_bytes=2**40, runtime_bytes=0)
    assert roomy.ranked[0].layout.ep == 1 and roomy.ranked[0].time.ep == 0


def test_the_start_up_check_offers_expert_parallelism():
    cfg = tiny_config(
        [
            *MOE,
            "model.moe.num_experts=16",
            "model.moe.ffn_hidden_size=1024",
            "trainer.global_batch_size=16",
            "trainer.micro_batch_size=1",
        ],
        1,
    )
    plan = make_plan(spec_of(cfg), layout_from_config(cfg, 4))
    options = dict(fitting_options(cfg, 4, 250, int(plan.peak_bytes * 0.6), 0))
    assert "parallel.ep=2" in options
    with_ep = make_plan(spec_of(cfg), layout_from_config(cfg, 4).with_(ep=2))
    assert options["parallel.ep=2"] == with_ep.peak_bytes < plan.peak_bytes


@pytest.mark.slow
def test_moe_plans_share_blocks_and_bound_the_step_time():
    cfg = tiny_config(
        [*MOE, "model.num_layers=8", "model.moe.layer_freq=2", "trainer.global_batch_size=16"], 1
    )
    spec = spec_of(cfg)
    planner = Planner(spec)
    for layout in valid_layouts(cfg, 8)[::23]:
        fast, full = planner.plan(layout, representative=True), make_plan(spec, layout)
        assert fast.peak_bytes == full.peak_bytes, layout.describe()
        for stage in fast.stages:
            assert stage == full.stages[stage.pp_rank], layout.describe()
        total = step_time(fast, H100)
        assert lower_bound(spec, layout, H100) <= total.total * (1 + 1e-12), layout.describe()
        assert (total.ep > 0) == (layout.ep > 1)


def test_the_report_shows_active_and_total_parameters_and_expert_memory(capsys):
    args = ["+experiment=moe_tiny", "world_size=2", "parallel.ep=2", "device_memory_gb=8"]
    assert plan_main([*args, "peak_tflops=1"]) == 0
    out = capsys.readouterr().out
    assert "mixture of experts: 2,036,864 active of 4,396,160 total parameters" in out
    assert "4 experts per rank (ep=2)" in out and "experts' params, grads and optimizer" in out
    assert "ep/all_to_all" in out and "tp=1 pp=1 dp=2 ep=2 zero=0" in out
    advise_args = [
        "+experiment=moe_tiny",
        "world_size=4",
        "peak_tflops=1",
        "advise=true",
        "device_memory_gb=8",
        "top=3",
    ]
    assert plan_main(advise_args) == 0
    out = capsys.readouterr().out
    assert "Fastest layout of each tp/cp/pp/ep" in out and "| ep s " in out


def test_moe_experiments_are_valid_plan_and_dry_run():
    from megatronish.train import dry_run_report

    tiny = load_config(["+experiment=moe_tiny"])
    assert config_errors(tiny, 1) == [] and config_errors(tiny, 2) == []
    assert "num_experts: 8" in dry_run_report(tiny, 1)
    cfg = load_config(["+experiment=moe_1b_7b", "model.vocab_size=32000", "world_size=8"])
    assert config_errors(cfg, 8, data=False) == []  # the data: the user's corpus
    report = dry_run_report(cfg, 8)
    assert "ep: 8" in report and "num_experts: 64" in report
    spec = spec_of(cfg)
    assert 6.5e9 < count_parameters(spec) < 7.2e9 and 1.1e9 < active_parameters(spec) < 1.4e9
    plan = make_plan(spec, layout_from_config(cfg, 8))
    assert plan.layout.ep == 8 and plan.stages[0].states.experts > 0
    assert plan.peak_bytes < 40 * 2**30  # 29.5 GiB per GPU (docs/planning.md)
    code = plan_main(
        ["+experiment=moe_1b_7b", "model.vocab_size=32000", "world_size=8", "device=h100"]
    )
    assert code == 0


def test_the_advisor_weighs_both_dispatch_orders_by_where_ep_runs():
    """Both orders are candidates wherever they differ (tp > 1 with sp); Megatron-LM's order
    (half the all-to-all bytes at tp 2, more tp bytes) wins once the ep group crosses nodes, and
    the default wins while it stays inside one; the written layout names the order."""
    from megatronish.plan.report import parallel_values
    from megatronish.plan.step_time import Hardware, step_time

    cfg = tiny_config([*MOE, "trainer.global_batch_size=8"], 1)
    orders: dict[tuple, set] = {}
    for x in valid_layouts(cfg, 4):
        key = (x.tp, x.cp, x.pp, x.vpp, x.sp, x.ep, x.micro_batch_size, x.zero_stage, x.recompute)
        orders.setdefault(key, set()).add(x.moe_dispatch_order)
    for key, got in orders.items():
        tp, sp = key[0], key[4]
        assert got == ({"tp_first", "ep_first"} if tp > 1 and sp else {"tp_first"}), key

    big = load_config(
        [
            "+experiment=moe_1b_7b",
            "trainer.micro_batch_size=1",
            "trainer.global_batch_size=64",
            "trainer.precision=bf16",
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.zero_stage=1",
        ]
    )
    spec, h100 = spec_of(big), Hardware(peak_flops=989e12, gpus_per_node=8)
    for ep, faster in ((8, "ep_first"), (4, "tp_first")):  # tp x ep spans 16 or 8 GPUs
        base = layout_from_config(big, 32).with_(ep=ep)
        times = {
            order: step_time(make_plan(spec, base.with_(moe_dispatch_order=order)), h100)
            for order in ("tp_first", "ep_first")
        }
        assert min(times, key=lambda o: times[o].total) == faster, (ep, times)
        ep_bytes = {o: make_plan(spec, base.with_(moe_dispatch_order=o)) for o in times}
        a2a = {o: p.stages[0].comm["ep/all_to_all"][1] for o, p in ep_bytes.items()}
        assert a2a["ep_first"] * 2 == pytest.approx(a2a["tp_first"], rel=1e-5)  # but the counts
    chosen = base.with_(moe_dispatch_order="ep_first")
    assert parallel_values(chosen)["moe_dispatch_order"] == "ep_first"
    assert "moe_dispatch_order" not in parallel_values(base)


def test_the_shared_experts_hide_part_of_each_forward_exchange():
    """parallel.moe_shared_expert_overlap: the ep term loses, per forward of a block, the shorter
    of one rows all-to-all (the volume's row bytes over its row calls) and the shared experts'
    forward; nothing without shared experts, with the overlap off or on shared CPU cores."""
    from megatronish.plan.hardware import comm_time
    from megatronish.plan.matmul_efficiency import efficiency
    from megatronish.plan.pipeline import stage_layers

    overrides = [
        "+experiment=moe_1b_7b",
        "model.moe.shared_experts=2",
        "trainer.micro_batch_size=1",
        "trainer.global_batch_size=64",
        "trainer.precision=bf16",
        "parallel.tp=2",
        "parallel.sp=true",
    ]
    h100 = Hardware(peak_flops=989e12, gpus_per_node=8)
    spec = spec_of(load_config(overrides))
    on = layout_from_config(load_config(overrides), 64).with_(ep=8)
    off = on.with_(moe_shared_expert_overlap=False)
    plan = make_plan(spec, on)
    hidden = step_time(make_plan(spec, off), h100).ep - step_time(plan, h100).ep

    moe = spec.moe
    blocks, m = rank_blocks(spec, on, 0).moe, on.num_microbatches
    calls, nbytes = plan.stages[0].comm["ep/all_to_all"]
    row_calls = m * 4 * blocks  # counts, rows and outputs forward; two row exchanges backward
    row_bytes = (nbytes - (calls - row_calls) * moe.num_experts * 8) / row_calls
    exchange = comm_time(on, h100, "ep/all_to_all", 1, int(row_bytes))
    rate = h100.peak_flops * efficiency(spec, on, h100, *stage_layers(spec, on, 0))
    tokens = spec.seq_length * on.micro_batch_size  # gathered over tp under sp
    shared = 2 * 3 * spec.hidden_size * 2 * moe.ffn_hidden_size // on.tp * tokens / rate
    assert hidden == pytest.approx(m * blocks * min(exchange, shared), rel=1e-9)
    assert 0 < hidden < step_time(make_plan(spec, off), h100).ep

    plain = replace(spec, moe=replace(moe, shared_experts=0))
    assert step_time(make_plan(plain, on), h100).ep == step_time(make_plan(plain, off), h100).ep
    cpu = Hardware(peak_flops=1e11, shared_cores=2)
    assert step_time(plan, cpu).ep == step_time(make_plan(spec, off), cpu).ep
