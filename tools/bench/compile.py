"""``trainer.compile``: step time of compiled (inductor) vs eager blocks, one process and tp=2,
and the first step's compile time with a cold and a warm inductor cache.
Run alone: ``.venv/bin/python tools/bench/compile.py [--quick]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import common
import torch.distributed as dist
from common import build_run, cli, interleaved, median, paired_ratio, slowest, table, threads

from megatronish.testing.multiproc import run_world

COMPILED = ["trainer.compile=true"]
WARMUP = 2  # the first compiled step compiles; both variants take two untimed steps
TP = ["parallel.tp=2", "parallel.sp=true"]


def first_step(extra: list[str]) -> dict:
    """Seconds of the first and second step of a fresh run in this process (2 threads)."""
    with threads(2):
        run = build_run(extra)
        out = {}
        for key in ("first_step_s", "second_step_s"):
            t0 = time.perf_counter()
            run.step()
            out[key] = time.perf_counter() - t0
    return out


def first_step_in_new_process(extra: list[str], cache: str) -> dict:
    """:func:`first_step` in a new Python process whose inductor cache is ``cache`` (a resumed
    run on the same node, or with ``trainer.compile_cache_dir``, finds it warm)."""
    code = (
        "import json, sys; sys.path.insert(0, 'tools/bench'); import compile as c; "
        f"print(json.dumps(c.first_step({extra!r})))"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=common.ROOT, env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def single(repeats: int, budget_s: float) -> dict:
    with threads(2):
        runs = {"eager": build_run(), "compiled": build_run(COMPILED)}
        losses = {name: [] for name in runs}

        def stepper(name):
            return lambda: losses[name].append(runs[name].step())

        times = interleaved(
            {n: stepper(n) for n in runs}, repeats, 1, warmup=WARMUP, budget_s=budget_s
        )
    return {"times": times, "losses": losses}


def _tp_rank(rank: int, world: int, repeats: int, budget_s: float) -> dict:
    runs = {
        "eager": build_run(TP, rank, world),
        "compiled": build_run([*TP, *COMPILED], rank, world),
    }
    first = {}
    for name, r in runs.items():  # both take a step here, so their losses stay comparable
        t0 = time.perf_counter()
        r.step()
        first[name] = time.perf_counter() - t0
    out = common.timed_world(
        {n: r.step for n, r in runs.items()}, repeats, 1, warmup=WARMUP, budget_s=budget_s
    )
    out["first_step_s"] = first
    dist.barrier()  # ranks leave together
    return out


def run(quick: bool = False) -> dict:
    repeats, budget = (3, 30.0) if quick else (21, 120.0)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as cache:
        cold = first_step_in_new_process(COMPILED, cache)
        warm = first_step_in_new_process(COMPILED, cache)
        eager = first_step_in_new_process([], cache)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # this process and its ranks reuse it
        one = single(repeats, budget)
        ranks = run_world(_tp_rank, 2, repeats, budget, timeout=1800, collective_timeout=600)
    tp_times = slowest(ranks)
    rows = []
    for name, times, losses in (
        ("1 process, 2 threads", one["times"], one["losses"]),
        ("tp=2 + sp, 1 thread per rank", tp_times, ranks[0]["losses"]),
    ):
        rows.append(
            [
                name,
                median(times["eager"]) * 1e3,
                median(times["compiled"]) * 1e3,
                paired_ratio(times["eager"], times["compiled"]),
                len(times["eager"]),
                losses["eager"][-1],
                losses["compiled"][-1],
            ]
        )
    return {
        "title": "Compiled blocks (trainer.compile, inductor) vs eager",
        "config": {"repeats": repeats, "budget_s": budget, "warmup": WARMUP, "tp": TP},
        "results": {
            "single": one,
            "tp": {"times": tp_times, "ranks": ranks},
            "first_step": {"cold": cold, "warm": warm, "eager": eager},
        },
        "tables": [
            table(
                "Step time (medians; the speed-up is the median of per-repeat ratios)",
                [
                    "layout",
                    "eager ms|.0f",
                    "compiled ms|.0f",
                    "speed-up|.2fx",
                    "repeats",
                    "eager last loss|.4f",
                    "compiled last loss|.4f",
                ],
                rows,
            ),
            table(
                "First step of a new process (1 process, 2 threads)",
                ["run", "first step s|.1f", "second step s|.2f"],
                [
                    ["eager", eager["first_step_s"], eager["second_step_s"]],
                    ["compiled, cold cache", cold["first_step_s"], cold["second_step_s"]],
                    ["compiled, warm cache", warm["first_step_s"], warm["second_step_s"]],
                ],
            ),
        ],
        "facts": {
            "tp=2 first step, slowest rank: eager (s)|.2f": max(
                r["first_step_s"]["eager"] for r in ranks
            ),
            "tp=2 first step, slowest rank: compiled (s)|.1f": max(
                r["first_step_s"]["compiled"] for r in ranks
            ),
            "1-minute load average, the larger of start and end|.1f": max(
                load_before, os.getloadavg()[0]
            ),
        },
    }


if __name__ == "__main__":
    cli(run, __doc__)
