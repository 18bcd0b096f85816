"""The layout advisor's step-time model against measured CPU step times.

Ten layouts of a small llama (8 layers, hidden 256, seq 128, 16 sequences per step) train a few
steps each in forked gloo worlds of 4 and 8 ranks on this machine, one thread per rank. The
advisor's model (``megatronish/plan/step_time.py``) predicts each step time from the planner's
FLOPs and communication volumes with inputs measured by probes (``advisor_probe.py``): one
thread's matmul FLOP/s, the efficiency of a one-process step, gloo's latency and bandwidth
between two ranks. The ranks outnumber the cores, so the model
runs with ``shared_cores``: every rank computes and communicates at ``cores / ranks`` of a core,
nothing overlaps, and a stage's bubble is free while the other stages' ranks keep every core
busy.

Run alone: ``.venv/bin/python tools/bench/bench_advisor.py [--quick]``.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from advisor_plot import draw
from advisor_probe import matmul_probe, network_probe
from common import DOCS, machine_info
from sections import bench_cli, table

from megatronish.config.compose import load_config
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.plan.step_time import TERMS, Hardware, step_time
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer

NAME = "advisor"
TITLE = "Layout advisor: predicted vs measured step times (CPU, 4 and 8 ranks)"
MODEL = [
    "model.num_layers=8", "model.hidden_size=256", "model.num_attention_heads=8",
    "model.num_query_groups=4", "model.ffn_hidden_size=704", "model.seq_length=128",
    "model.vocab_size=512", "trainer.global_batch_size=16", "trainer.micro_batch_size=4",
    "trainer.max_steps=1000000", "trainer.eval_interval=0", "trainer.device=cpu",
    "scheduler.style=constant", "scheduler.warmup_steps=0", "logging.wandb=false",
    "logging.log_interval=1000000",
]  # fmt: skip
LAYOUTS = [
    (4, ["trainer.micro_batch_size=4"]),
    (4, ["parallel.tp=2", "trainer.micro_batch_size=2"]),
    (4, ["parallel.tp=4", "parallel.sp=true"]),
    (4, ["parallel.pp=2", "trainer.micro_batch_size=2"]),
    (4, ["parallel.pp=4", "trainer.micro_batch_size=1"]),
    (4, ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "trainer.micro_batch_size=1"]),
    (4, ["parallel.zero_stage=3", "trainer.recompute=full"]),
    (8, ["trainer.micro_batch_size=2", "parallel.zero_stage=1"]),
    (8, ["parallel.tp=2", "parallel.pp=2", "trainer.micro_batch_size=2"]),
    (8, ["parallel.tp=4", "parallel.sp=true", "trainer.recompute=selective"]),
]
# Measured phases (megatronish/distributed/timers.py) next to the model's terms.
PHASES = {
    "fwd+bwd": ("forward", "backward"),  # compute, recompute and tp communication
    "pp wait": ("pp_recv_wait", "pp_send_wait"),  # bubble and pipeline transfers
    "dp wait": ("grad_reduce_wait", "param_gather"),
    "other": ("optimizer", "data"),  # not modelled
}
PLOT = DOCS / "advisor.png"


def _rank(rank: int, world: int, overrides: list[str], warmup: int, steps: int) -> dict:
    """Seconds of each timed step on this rank (a barrier before each) and its phase timers."""
    torch.set_num_threads(1)
    trainer = build_trainer(rank, world, overrides, 1_000_000, model=MODEL)
    for _ in range(warmup):
        trainer.train_step()
    trainer.timers.reset()
    times = []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    if world > 1:
        dist.barrier()
    phases = {
        name: sum(trainer.timers.totals[k] for k in keys) / steps for name, keys in PHASES.items()
    }
    return {"times": times, "phases": phases}


def measure(world: int, overrides: list[str], warmup: int, steps: int) -> dict:
    """Per step the slowest rank's seconds; per phase the largest rank's seconds per step."""
    if world == 1:
        ranks = [_rank(0, 1, overrides, warmup, steps)]
    else:
        ranks = run_world(
            _rank, world, overrides, warmup, steps, timeout=600, collective_timeout=300
        )
    times = [max(r["times"][i] for r in ranks) for i in range(steps)]
    phases = {k: max(r["phases"][k] for r in ranks) for k in PHASES}
    return {"times": times, "median_s": statistics.median(times), "phases": phases}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def _label(layout) -> str:
    """A short name for the plot, e.g. ``tp2 pp2 vpp2 dp1 mbs1``."""
    parts = [f"tp{layout.tp}"] if layout.tp > 1 else []
    parts += [f"pp{layout.pp}"] if layout.pp > 1 else []
    parts += [f"vpp{layout.vpp}"] if layout.vpp > 1 else []
    parts += [f"dp{layout.dp}"] + (["sp"] if layout.sequence_parallel else [])
    parts += [f"z{layout.zero_stage}"] if layout.zero_stage else []
    parts += [layout.recompute] if layout.recompute != "none" else []
    return " ".join([*parts, f"mbs{layout.micro_batch_size}"])


def calibrate(warmup: int, steps: int) -> dict:
    """Probe values: peak, one-process efficiency, network (per core of their own)."""
    peak = matmul_probe()
    single = measure(1, [], warmup, steps)["median_s"]
    cfg = load_config(MODEL)
    plan = make_plan(spec_of(cfg), layout_from_config(cfg, 1))
    efficiency = plan.hardware_flops_per_step / (single * peak)
    return {"peak_flops": peak, "one_process_s": single, "efficiency": efficiency,
            "network": network_probe()}  # fmt: skip


def run(quick: bool = False) -> dict:
    """The section result (see ``sections.py``)."""
    t0 = time.perf_counter()
    warmup, steps = (1, 2) if quick else (1, 3)
    cal = calibrate(warmup, steps)
    spec = spec_of(load_config(MODEL))
    rows = []
    net = cal["network"]
    cores = os.cpu_count() or 1
    for world, overrides in LAYOUTS:
        hw = Hardware(
            peak_flops=cal["peak_flops"], efficiency=cal["efficiency"], gpus_per_node=world,
            intra_node_bw=net["bandwidth"], inter_node_bw=net["bandwidth"],
            latency_s=net["latency_s"], shared_cores=cores,
        )  # fmt: skip
        plan = make_plan(spec, layout_from_config(load_config([*MODEL, *overrides]), world))
        predicted = step_time(plan, hw)
        got = measure(world, overrides, warmup, steps)
        rows.append({
            "world": world, "layout": plan.layout.describe(), "label": _label(plan.layout),
            "predicted_s": predicted.total, "terms_s": predicted.terms(),
            "measured_s": got["median_s"], "step_times_s": got["times"],
            "phases_s": got["phases"], "relative_error": predicted.total / got["median_s"] - 1,
        })  # fmt: skip
        print(f"{world} {rows[-1]['layout']}: predicted {predicted.total:.3f} s, measured "
              f"{got['median_s']:.3f} s", flush=True)  # fmt: skip
    draw(rows, PLOT)
    return section(rows, cal, warmup, steps, quick, time.perf_counter() - t0)


def _span(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}x" if values else "n/a"


def term_notes(rows: list[dict]) -> list[str]:
    """Which of the model's terms are off: measured phase over predicted term, per kind."""
    no_tp = [r for r in rows if "tp=1 " in r["layout"]]
    with_tp = [r for r in rows if "tp=1 " not in r["layout"]]

    def compute(r):
        return r["terms_s"]["compute"] + r["terms_s"]["recompute"]

    fwd_bwd = [r["phases_s"]["fwd+bwd"] / compute(r) for r in no_tp]
    tp = [(r["phases_s"]["fwd+bwd"] - compute(r)) / r["terms_s"]["tp"] for r in with_tp]
    dp = [r["phases_s"]["dp wait"] / r["terms_s"]["dp"] for r in rows if r["terms_s"]["dp"]]
    piped = [r for r in rows if "pp=1 " not in r["layout"]]
    pp = [r["phases_s"]["pp wait"] for r in piped]
    pp_model = [r["terms_s"]["bubble"] + r["terms_s"]["pp"] for r in piped]
    other = [r["phases_s"]["other"] / r["measured_s"] for r in rows]
    return [
        f"Compute: without tp, measured forward + backward is {_span(fwd_bwd)} the predicted "
        f"compute (+ recompute). tp: measured forward + backward less the predicted compute is "
        f"{_span(tp)} the predicted tp time, the term that is most off: gloo's collectives "
        "between time-shared ranks cost more per call than the 2-rank probe on idle cores "
        "shows (a collective waits until every member has had its share of a core).",
        f"dp: measured waits are {_span(dp)} the predicted exposed dp time. Pipelines: "
        f"measured waits {min(pp):.2f}-{max(pp):.2f} s against a predicted bubble + pp of "
        f"{min(pp_model):.2f}-{max(pp_model):.2f} s, mostly time the waiting rank's core gave "
        f"to other ranks. Not modelled: the optimizer update and data, "
        f"{min(other):.0%}-{max(other):.0%} of the measured step.",
    ]


def section(rows, cal, warmup, steps, quick, seconds) -> dict:
    """The benchmark's section: method, tables, notes."""
    net, cores = cal["network"], os.cpu_count() or 1
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    median_error = statistics.median(abs(r["relative_error"]) for r in rows)
    spec = spec_of(load_config(MODEL))
    probe_rows = [
        ["matmul, 1 thread (fp32, 1024^3)", f"{cal['peak_flops'] / 1e9:.1f} GFLOP/s"],
        ["one-process step (1 thread)", f"{cal['one_process_s'] * 1e3:.0f} ms"],
        ["efficiency = hardware FLOPs / (step * peak)", f"{cal['efficiency']:.2f}"],
        ["gloo 2-rank all-reduce, 128 KiB / 256 KiB / 512 KiB / 1 MiB / 4 MiB",
         " / ".join(f"{t * 1e3:.2f}" for t in net["all_reduce_s"].values())
         + " ms"],
        ["latency: the fitted line at 0 bytes", f"{net['latency_s'] * 1e6:.0f} us"],
        ["bandwidth: 1 / the fitted line's slope", f"{net['bandwidth'] / 1e9:.2f} GB/s"],
        ["(not used) one-float ping-pong, one way", f"{net['ping_pong_s'] * 1e6:.0f} us"],
    ]  # fmt: skip
    layout_rows = [
        [r["world"], r["layout"], f"{r['predicted_s']:.2f}",
         f"{r['measured_s']:.2f}", f"{r['relative_error']:+.0%}",
         " / ".join(f"{r['terms_s'][k]:.2f}" for k in TERMS),
         " / ".join(f"{r['phases_s'][k]:.2f}" for k in PHASES)]
        for r in rows
    ]  # fmt: skip
    best_pred = min(rows, key=lambda r: r["predicted_s"])
    best_meas = min(rows, key=lambda r: r["measured_s"])
    method = (
        f"The validation model is a llama of {spec.num_layers} layers, hidden "
        f"{spec.hidden_size}, {spec.num_heads} heads / {spec.num_kv_heads} kv heads, ffn "
        f"{spec.ffn_hidden_size}, vocab {spec.vocab_size}, seq {spec.seq_length}, 16 sequences "
        f"per step, fp32. Each layout trains in a forked gloo world (one thread per rank): "
        f"{warmup} warm-up step(s), then {steps} timed steps with a barrier before each; a "
        "step's time is the slowest rank's; the table gives the median. The prediction is "
        "`step_time(make_plan(...), hw)` with the probe values below, one 'node' (one "
        f"bandwidth) and `shared_cores` = {cores}, the machine's cores: with N ranks each "
        f"rank computes and communicates at {cores}/N of a core, communication does not "
        "overlap compute, and the bubble costs only the cores a pipeline stage's ranks leave "
        "idle. The machine is shared with other jobs, which slow some runs; the efficiency is "
        "calibrated on the one-process run (not one of the compared layouts) at the start."
    )
    notes = [
        f"Spearman rank correlation of predicted and measured step times: {rho:.2f} over "
        f"{len(rows)} layouts (target >= 0.8); median relative error {median_error:.0%}.",
        f"Fastest predicted: {best_pred['layout']} on {best_pred['world']} ranks; fastest "
        f"measured: {best_meas['layout']} on {best_meas['world']} ranks.",
        "Terms: "
        + " / ".join(TERMS)
        + " (the model's seconds per step); measured phases: "
        + " / ".join(f"{k} ({' + '.join(v)})" for k, v in PHASES.items())
        + ", the largest rank's seconds per step (fwd+bwd includes tp communication; "
        "'other' is not modelled).",
        *term_notes(rows),
        "The scatter plot is docs/advisor.png.",
    ]
    return {
        "name": NAME,
        "title": TITLE,
        "method": method,
        "quick": quick,
        "tables": [
            table("Probes (inputs of the model)", ["probe", "value"], probe_rows),
            table(
                "Predicted vs measured step time (s)",
                [
                    "ranks",
                    "layout",
                    "predicted",
                    "measured",
                    "error",
                    "model: " + " / ".join(TERMS),
                    "measured: " + " / ".join(PHASES),
                ],
                layout_rows,
            ),  # fmt: skip
        ],
        "notes": notes,
        "raw": {
            "rows": rows,
            "spearman": rho,
            "median_relative_error": median_error,
            "calibration": cal,
            "cpu_count": os.cpu_count(),
        },  # fmt: skip
        "seconds": seconds,
        "machine": machine_info(),
    }


if __name__ == "__main__":
    bench_cli(run, __doc__.splitlines()[0])
