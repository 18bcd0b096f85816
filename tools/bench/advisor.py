"""The layout advisor's step-time model (``megatronish/plan/step_time.py``) against measured
step times of ten layouts on 4 and 8 CPU ranks, calibrated by probes of this machine.
Run alone: ``.venv/bin/python tools/bench/advisor.py [--quick]``.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from common import cli, table, threads

from megatronish.config.compose import load_config
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.plan.step_time import TERMS, Hardware, step_time
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer
from megatronish.training.peaks import measure_matmul_peak

MODEL = [
    "model.num_layers=8",
    "model.hidden_size=256",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=704",
    "model.seq_length=128",
    "model.vocab_size=512",
    "trainer.global_batch_size=16",
    "trainer.micro_batch_size=4",
    "trainer.max_steps=1000000",
    "trainer.eval_interval=0",
    "trainer.device=cpu",
    "scheduler.style=constant",
    "scheduler.warmup_steps=0",
    "logging.wandb=false",
    "logging.log_interval=1000000",
]
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
SIZES = (1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 22)  # all-reduce probe bytes


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
    totals = trainer.timers.totals
    phases = {name: sum(totals[k] for k in keys) / steps for name, keys in PHASES.items()}
    return {"times": times, "phases": phases}


def measure(world: int, overrides: list[str], warmup: int, steps: int) -> dict:
    """Per step the slowest rank's seconds; per phase the largest rank's seconds per step."""
    args = (overrides, warmup, steps)
    ranks = (
        [_rank(0, 1, *args)]
        if world == 1
        else run_world(_rank, world, *args, timeout=600, collective_timeout=300)
    )
    times = [max(r["times"][i] for r in ranks) for i in range(steps)]
    phases = {k: max(r["phases"][k] for r in ranks) for k in PHASES}
    return {"times": times, "median_s": statistics.median(times), "phases": phases}


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _network_rank(rank: int, world: int, repeats: int) -> dict:
    msg, peer = torch.zeros(1), 1 - rank

    def ping_pong() -> None:
        for _ in range(10):
            first, second = (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send)
            first(msg, peer)
            second(msg, peer)

    out = {"ping_pong_s": _timed(ping_pong, repeats) / 20}  # one way
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)  # warm-up
        out[nbytes] = _timed(lambda x=x: dist.all_reduce(x), repeats)
    return out


def network_probe(repeats: int = 25) -> dict:
    """gloo between two ranks: latency and bandwidth of the line ``latency + bytes /
    bandwidth`` through the all-reduce times with the least squared relative residuals."""
    results = run_world(_network_rank, 2, repeats)
    times = {n: max(r[n] for r in results) for n in SIZES}
    w = [1 / times[n] ** 2 for n in SIZES]
    mx = sum(wi * x for wi, x in zip(w, SIZES)) / sum(w)
    my = sum(wi * times[n] for wi, n in zip(w, SIZES)) / sum(w)
    per_byte = sum(wi * (x - mx) * (times[x] - my) for wi, x in zip(w, SIZES)) / sum(
        wi * (x - mx) ** 2 for wi, x in zip(w, SIZES)
    )
    return {
        "all_reduce_s": {str(n): t for n, t in times.items()},
        "ping_pong_s": max(r["ping_pong_s"] for r in results),
        "latency_s": max(my - per_byte * mx, 0.0),
        "bandwidth": 1 / per_byte,
    }


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: list[float]) -> list[float]:
        return [sum(x < y for x in v) + (sum(x == y for x in v) - 1) / 2 for y in v]

    return statistics.correlation(ranks(xs), ranks(ys))


def _label(layout) -> str:
    """A short name for the plot, e.g. ``tp2 pp2 vpp2 dp1 mbs1``."""
    parts = [f"tp{layout.tp}"] if layout.tp > 1 else []
    parts += [f"pp{layout.pp}"] if layout.pp > 1 else []
    parts += [f"vpp{layout.vpp}"] if layout.vpp > 1 else []
    parts += [f"dp{layout.dp}"] + (["sp"] if layout.sequence_parallel else [])
    parts += [f"z{layout.zero_stage}"] if layout.zero_stage else []
    parts += [layout.recompute] if layout.recompute != "none" else []
    return " ".join([*parts, f"mbs{layout.micro_batch_size}"])


def run(quick: bool = False) -> dict:
    warmup, steps = (1, 2) if quick else (1, 3)
    with threads(1):  # calibration: the best one-thread matmul, a one-process step
        peak = max(measure_matmul_peak(1024, 5) for _ in range(3))
    single = measure(1, [], warmup, steps)["median_s"]
    cfg = load_config(MODEL)
    spec = spec_of(cfg)
    flops = make_plan(spec, layout_from_config(cfg, 1)).hardware_flops_per_step
    efficiency = flops / (single * peak)
    net, cores = network_probe(), os.cpu_count() or 1
    hw = {
        "peak_flops": peak,
        "efficiency": efficiency,
        "intra_node_bw": net["bandwidth"],
        "inter_node_bw": net["bandwidth"],
        "latency_s": net["latency_s"],
        "shared_cores": cores,
    }
    rows = []
    for world, overrides in LAYOUTS:
        plan = make_plan(spec, layout_from_config(load_config([*MODEL, *overrides]), world))
        predicted = step_time(plan, Hardware(gpus_per_node=world, **hw))
        got = measure(world, overrides, warmup, steps)
        rows.append(
            {
                "world": world,
                "layout": plan.layout.describe(),
                "label": _label(plan.layout),
                "predicted_s": predicted.total,
                "terms_s": predicted.terms(),
                "measured_s": got["median_s"],
                "step_times_s": got["times"],
                "phases_s": got["phases"],
                "relative_error": predicted.total / got["median_s"] - 1,
            }
        )
        print(
            f"{world} {rows[-1]['layout']}: predicted {predicted.total:.3f} s, measured "
            f"{got['median_s']:.3f} s",
            flush=True,
        )
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    median_error = statistics.median(abs(r["relative_error"]) for r in rows)
    fastest = {k: min(rows, key=lambda r, k=k: r[k]) for k in ("predicted_s", "measured_s")}
    compute = {id(r): r["terms_s"]["compute"] + r["terms_s"]["recompute"] for r in rows}
    no_tp = [r for r in rows if "tp=1 " in r["layout"]]
    piped = [r for r in rows if "pp=1 " not in r["layout"]]

    def span(values: list[float]) -> list[float]:
        return [min(values), max(values)] if values else []

    return {
        "title": "Layout advisor: predicted vs measured step times (CPU, 4 and 8 ranks)",
        "config": {
            "warmup": warmup,
            "steps": steps,
            "model": MODEL,
            "layouts": LAYOUTS,
            "shared_cores": cores,
        },
        "results": {
            "rows": rows,
            "spearman": rho,
            "median_relative_error": median_error,
            "calibration": {
                "peak_flops": peak,
                "one_process_s": single,
                "efficiency": efficiency,
                "network": net,
            },
        },
        "tables": [
            table(
                "Predicted vs measured step time (s)",
                [
                    "ranks",
                    "layout",
                    "predicted|.2f",
                    "measured|.2f",
                    "error|+.0%",
                    "model: " + " / ".join(TERMS) + "|.2f",
                    "measured: " + " / ".join(PHASES) + "|.2f",
                ],
                [
                    [
                        r["world"],
                        r["layout"],
                        r["predicted_s"],
                        r["measured_s"],
                        r["relative_error"],
                        [r["terms_s"][k] for k in TERMS],
                        [r["phases_s"][k] for k in PHASES],
                    ]
                    for r in rows
                ],
            ),
        ],
        "facts": {
            "probe: matmul, 1 thread (fp32, 1024^3), GFLOP/s|.1f": peak / 1e9,
            "probe: one-process step (1 thread), ms|.0f": single * 1e3,
            "probe: efficiency = hardware FLOPs / (step * peak)|.2f": efficiency,
            "probe: gloo 2-rank all-reduce of 128 KiB / 256 KiB / 512 KiB / 1 MiB / 4 MiB, "
            "ms|.2f": [t * 1e3 for t in net["all_reduce_s"].values()],
            "probe: latency, the fitted line at 0 bytes, us|.0f": net["latency_s"] * 1e6,
            "probe: bandwidth, 1 / the fitted line's slope, GB/s|.2f": net["bandwidth"] / 1e9,
            "probe (not used): one-float ping-pong, one way, us|.0f": net["ping_pong_s"] * 1e6,
            "Spearman rank correlation of predicted and measured (target >= 0.8)|.2f": rho,
            "median relative error|.0%": median_error,
            **{
                f"fastest {k[:-2]}": f"{r['layout']} on {r['world']} ranks"
                for k, r in fastest.items()
            },
            "without tp: measured fwd+bwd / predicted compute (+ recompute), min / max|.1fx": span(
                [r["phases_s"]["fwd+bwd"] / compute[id(r)] for r in no_tp]
            ),
            "with tp: (measured fwd+bwd - predicted compute) / predicted tp, min / max|.1fx": span(
                [
                    (r["phases_s"]["fwd+bwd"] - compute[id(r)]) / r["terms_s"]["tp"]
                    for r in rows
                    if r not in no_tp
                ]
            ),
            "measured dp wait / predicted exposed dp, min / max|.1fx": span(
                [r["phases_s"]["dp wait"] / r["terms_s"]["dp"] for r in rows if r["terms_s"]["dp"]]
            ),
            "pipelines: measured pp wait, min / max, s|.2f": span(
                [r["phases_s"]["pp wait"] for r in piped]
            ),
            "pipelines: predicted bubble + pp, min / max, s|.2f": span(
                [r["terms_s"]["bubble"] + r["terms_s"]["pp"] for r in piped]
            ),
            "not modelled (optimizer + data), share of the measured step, min / max|.0%": span(
                [r["phases_s"]["other"] / r["measured_s"] for r in rows]
            ),
        },
    }


if __name__ == "__main__":
    cli(run, __doc__)
