"""Single-process training throughput: megatronish's Trainer vs the plain-PyTorch reference GPT
at 2 and 1 intra-op threads. Run alone: ``.venv/bin/python tools/bench/single.py [--quick]``.
"""

from __future__ import annotations

import math
import os
import time

from common import build_run, cli, interleaved, median, paired_ratio, reference_run, table, threads

from megatronish.model.flops import flops_per_token
from megatronish.training.peaks import measure_matmul_peak

WARMUP = 2


def measure(num_threads: int, repeats: int, steps: int, budget_s: float) -> dict:
    """Interleaved step times, CPU times, losses and the matmul peak at ``num_threads``."""
    with threads(num_threads):
        mish = build_run()
        ref = reference_run(mish.cfg, mish.spec, mish.data)
        losses = {"megatronish": [], "reference": []}
        cpu = {"megatronish": [], "reference": []}

        def recorded(name, step):
            def one():
                t0 = time.process_time()
                losses[name].append(step())
                cpu[name].append(time.process_time() - t0)

            return one

        runs = {"megatronish": recorded("megatronish", mish.step)}
        runs["reference"] = recorded("reference", ref.step)
        peak_before = measure_matmul_peak()
        times = interleaved(runs, repeats, steps, warmup=WARMUP, budget_s=budget_s)
        peak = max(peak_before, measure_matmul_peak())
    cpu = {
        n: [sum(ts[i : i + steps]) / steps for i in range(WARMUP, len(ts), steps)]
        for n, ts in cpu.items()
    }
    tokens = mish.cfg.trainer.global_batch_size * mish.spec.seq_length
    flops = flops_per_token(mish.spec) * tokens
    out = {
        "threads": num_threads,
        "peak_flops": peak,
        "tokens_per_step": tokens,
        "repeats": len(times["megatronish"]),
        "flops_per_step": flops,
    }
    for name, ts in times.items():
        out[name] = {
            "step_times_s": ts,
            "median_step_s": median(ts),
            "tokens_per_s": tokens / median(ts),
            "mfu": flops / median(ts) / peak,
            "first_loss": losses[name][0],
            "last_loss": losses[name][-1],
            "steps": len(losses[name]),
        }
    out["ratio"] = out["megatronish"]["tokens_per_s"] / out["reference"]["tokens_per_s"]
    out["paired_ratio"] = paired_ratio(times["reference"], times["megatronish"])
    out["cpu_ratio"] = paired_ratio(cpu["reference"], cpu["megatronish"])
    out["cpu_s"] = cpu
    out["fastest_ratio"] = min(times["reference"]) / min(times["megatronish"])
    out["ln_vocab"] = math.log(mish.spec.vocab_size)
    return out


def run(quick: bool = False) -> dict:
    load_before = os.getloadavg()[0]
    # Many short repeats: per-repeat ratios of back-to-back steps cancel the load swings.
    repeats, steps, budget = (3, 1, 20.0) if quick else (31, 1, 60.0)
    runs = [measure(n, repeats, steps, budget) for n in (2, 1)]
    m = [(r, r["megatronish"], r["reference"]) for r in runs]
    first = runs[0]
    return {
        "title": "Single-process training throughput (tiny llama)",
        "config": {
            "repeats": repeats,
            "steps_per_repeat": steps,
            "budget_s": budget,
            "warmup": WARMUP,
            "threads": [2, 1],
        },
        "results": {"runs": runs},
        "tables": [
            table(
                "Throughput",
                [
                    "threads",
                    "megatronish tokens/s|,.0f",
                    "reference tokens/s|,.0f",
                    "megatronish / reference|.2fx",
                    "same, median of per-repeat ratios|.2fx",
                    "same, fastest repeats|.2fx",
                    "CPU time, median of per-repeat ratios|.2fx",
                    "megatronish MFU|.1%",
                    "reference MFU|.1%",
                    "matmul peak GFLOP/s|.0f",
                ],
                [
                    [
                        r["threads"],
                        a["tokens_per_s"],
                        b["tokens_per_s"],
                        r["ratio"],
                        r["paired_ratio"],
                        r["fastest_ratio"],
                        r["cpu_ratio"],
                        a["mfu"],
                        b["mfu"],
                        r["peak_flops"] / 1e9,
                    ]
                    for r, a, b in m
                ],
            ),
            table(
                "Sanity: same weights and batches give the same losses",
                [
                    "threads",
                    "ln(vocab)|.4f",
                    "megatronish first loss|.4f",
                    "reference first loss|.4f",
                    "steps",
                    "megatronish last loss|.4f",
                    "reference last loss|.4f",
                ],
                [
                    [
                        r["threads"],
                        r["ln_vocab"],
                        a["first_loss"],
                        b["first_loss"],
                        a["steps"],
                        a["last_loss"],
                        b["last_loss"],
                    ]
                    for r, a, b in m
                ],
            ),
        ],
        "facts": {
            "repeats run at 2 / 1 threads": [r["repeats"] for r in runs],
            "model FLOPs per token (MFLOP)|.2f": first["flops_per_step"]
            / first["tokens_per_step"]
            / 1e6,
            "1-minute load average, the larger of start and end|.1f": max(
                load_before, os.getloadavg()[0]
            ),
        },
    }


if __name__ == "__main__":
    cli(run, __doc__)
