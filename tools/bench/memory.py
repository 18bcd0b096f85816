"""Activation memory per rank, measured by profiling the allocator over a step, vs the planner
and Korthikanti et al.'s formulas. Run alone: ``.venv/bin/python tools/bench/memory.py``.
"""

from __future__ import annotations

from common import MIB, cli, korthikanti, table

from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.plan.pipeline import interleaving_factor
from megatronish.testing.memory import least_activations, measure_step
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, test_config

S, B, H, A = 128, 4, 128, 4
MODEL = [
    "model.arch=gpt2",
    f"model.hidden_size={H}",
    f"model.num_attention_heads={A}",
    "model.num_query_groups=null",
    f"model.ffn_hidden_size={4 * H}",
    f"model.seq_length={S}",
    f"trainer.micro_batch_size={B}",
    f"trainer.global_batch_size={4 * B}",
    "model.vocab_size=1000",
]
# tp=2 layouts run with dp=2: in 2-rank tp worlds gloo's threads keep collective buffers alive
# for varying times.
LAYOUTS = {  # name -> (world, overrides)
    "tp=1": (1, []),
    "tp=1 selective": (1, ["trainer.recompute=selective"]),
    "tp=1 full": (1, ["trainer.recompute=full"]),
    "tp=2": (4, ["parallel.tp=2"]),
    "tp=2 sp": (4, ["parallel.tp=2", "parallel.sp=true"]),
    "tp=2 sp selective": (4, ["parallel.tp=2", "parallel.sp=true", "trainer.recompute=selective"]),
    "tp=2 sp full": (4, ["parallel.tp=2", "parallel.sp=true", "trainer.recompute=full"]),
}
PIPELINES = {  # name -> (world, overrides); 8 layers, 8 microbatches of 1
    "pp=2": (2, ["parallel.pp=2"]),
    "pp=2 vpp=2": (2, ["parallel.pp=2", "parallel.vpp=2"]),
    "pp=4": (4, ["parallel.pp=4"]),
    "pp=4 vpp=2": (4, ["parallel.pp=4", "parallel.vpp=2"]),
}
PIPE_MODEL = ["model.num_layers=8", "trainer.micro_batch_size=1", "trainer.global_batch_size=8"]


def _measure(rank: int, world: int, overrides: list[str], repeats: int) -> tuple[int, int]:
    """After a warm-up step, the smallest complete activation peak of ``repeats`` steps."""
    trainer = build_trainer(rank, world, overrides, steps=repeats + 2)
    trainer.train_step()
    runs = [measure_step(trainer) for _ in range(repeats)]
    return trainer.topo.coords.pp, least_activations(runs)


def measure(world: int, overrides: list[str], repeats: int) -> dict[int, int]:
    """Each pipeline stage's activation peak: the lower median over its ranks."""
    if world == 1:
        return {0: _measure(0, 1, overrides, repeats)[1]}
    by_stage: dict[int, list[int]] = {}
    for pp_rank, act in run_world(_measure, world, overrides, repeats):
        by_stage.setdefault(pp_rank, []).append(act)
    return {pp: sorted(v)[(len(v) - 1) // 2] for pp, v in by_stage.items()}


def planned(world: int, overrides: list[str]):
    cfg = test_config(overrides, 1)
    return make_plan(spec_of(cfg), layout_from_config(cfg, world))


def run(quick: bool = False) -> dict:
    repeats = 2 if quick else 4
    rows, raw = [], {}
    for name, (world, extra) in LAYOUTS.items():
        four = measure(world, [*MODEL, "model.num_layers=4", *extra], repeats)[0]
        two = measure(world, [*MODEL, "model.num_layers=2", *extra], repeats)[0]
        act = planned(world, [*MODEL, "model.num_layers=4", *extra]).stages[0].activations
        t, sp = (2 if "tp=2" in name else 1), "sp" in name
        k = korthikanti(S, B, H, A, t, sp)
        pub, fp32 = k["16bit"], k["fp32_no_attn"]
        if "selective" in name:
            pub -= 5 * A * S * S * B / t
        if "full" in name:  # one layer input (2 bytes published, 4 in fp32)
            pub, fp32 = 2 * S * B * H / (t if sp else 1), 4 * S * B * H / (t if sp else 1)
        raw[name] = {
            "measured_rank": four,
            "measured_layer": (four - two) / 2,
            "planned_rank": act.peak,
            "planned_layer": act.per_layer,
            "korthikanti_16bit": pub,
            "korthikanti_fp32": fp32,
        }
        rows.append(
            [
                name,
                (four - two) / 2 / MIB,
                act.per_layer / MIB,
                fp32 / MIB,
                pub / MIB,
                four / MIB,
                act.peak / MIB,
                act.peak / four,
            ]
        )
    pipe_rows = []
    for name, (world, extra) in PIPELINES.items():
        overrides = [*MODEL, *PIPE_MODEL, *extra]
        got = measure(world, overrides, repeats)[0]
        plan = planned(world, overrides)
        lay, st = plan.layout, plan.stages[0].activations
        raw[name] = {
            "measured_first_stage": got,
            "planned_first_stage": st.peak,
            "planned_in_flight": st.in_flight,
        }
        pipe_rows.append(
            [
                name,
                st.in_flight,
                lay.pp * interleaving_factor(lay.pp, lay.vpp),
                got / MIB,
                st.peak / MIB,
                st.peak / got,
            ]
        )
    return {
        "title": "Activation memory per rank: measured vs the planner and Korthikanti et al.",
        "config": {"repeats": repeats, "model": MODEL, "pipeline_model": PIPE_MODEL},
        "results": raw,
        "tables": [
            table(
                f"Per layer and per rank (MiB), s={S} b={B} h={H} a={A}, 4 layers, fp32",
                [
                    "layout",
                    "measured per layer|.2f",
                    "planner per layer|.2f",
                    "Korthikanti fp32, no dropout|.2f",
                    "Korthikanti as published (16-bit)|.2f",
                    "measured per rank|.2f",
                    "planner per rank|.2f",
                    "planner / measured|.2f",
                ],
                rows,
            ),
            table(
                "Pipeline: first stage, 8 layers, 8 microbatches of 1 (MiB)",
                [
                    "layout",
                    "in flight (schedule walk)|.2f",
                    "p (1 + (p-1)/(p v)) (Korthikanti)|.2f",
                    "measured|.2f",
                    "planner|.2f",
                    "planner / measured|.2f",
                ],
                pipe_rows,
            ),
        ],
    }


if __name__ == "__main__":
    cli(run, __doc__)
