"""Mixture-of-experts dispatch on CPU, side by side in one 4-rank world: tp=2 x ep=2 with
sequence parallelism in both dispatch orders (tp_first, megatronish's default, and ep_first,
Megatron-LM's), and ep=2 x dp=2 with a shared expert whose forward runs while the tokens travel
or after them. Run alone: ``.venv/bin/python tools/bench/moe_dispatch.py [--quick]``.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from common import MIB, build_run, cli, config, median, paired_ratio, slowest, table, timed_world

from megatronish.testing.multiproc import run_world

MOE = [
    "model.moe.num_experts=8",
    "model.moe.top_k=2",
    "model.moe.ffn_hidden_size=256",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=8",
]
TP_FIRST, EP_FIRST = "tp=2 ep=2 sp, tp_first", "tp=2 ep=2 sp, ep_first (Megatron's)"
OVERLAP, NO_OVERLAP = "ep=2 dp=4 + shared expert, overlapped", "ep=2 dp=4 + shared expert, after"
VARIANTS = {
    TP_FIRST: ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2"],
    EP_FIRST: [
        "parallel.tp=2",
        "parallel.sp=true",
        "parallel.ep=2",
        "parallel.moe_dispatch_order=ep_first",
    ],
    OVERLAP: ["parallel.ep=2", "model.moe.shared_experts=1"],
    NO_OVERLAP: [
        "parallel.ep=2",
        "model.moe.shared_experts=1",
        "parallel.moe_shared_expert_overlap=false",
    ],
}
PAIRS = ((TP_FIRST, EP_FIRST), (NO_OVERLAP, OVERLAP))
WORLD = 4


def _rank(rank: int, world: int, repeats: int, budget_s: float) -> dict:
    runs = {n: build_run([*MOE, *extra], rank, world) for n, extra in VARIANTS.items()}
    steppers = {n: r.step for n, r in runs.items()}
    dist.barrier()
    first = {n: step() for n, step in steppers.items()}  # not timed
    for r in runs.values():
        r.trainer.topo.stats.reset()
    out = timed_world(steppers, repeats, 1, warmup=1, budget_s=budget_s)
    steps = {n: len(out["losses"][n]) for n in runs}  # the warm-up step and the timed ones
    out["comm"] = {
        n: {
            k: {m: v / steps[n] for m, v in c.items()}
            for k, c in r.trainer.topo.stats.summary().items()
        }
        for n, r in runs.items()
    }
    out["first"] = first
    dist.barrier()
    return out


def run(quick: bool = False) -> dict:
    load_before = os.getloadavg()[0]
    repeats, budget = (3, 10.0) if quick else (31, 90.0)
    ranks = run_world(_rank, WORLD, repeats, budget, timeout=900, collective_timeout=300)
    times = slowest(ranks)
    med = {n: median(ts) for n, ts in times.items()}
    cfg = config(MOE)
    tokens = cfg.trainer.global_batch_size * cfg.model.seq_length
    ratio = {b: paired_ratio(times[a], times[b]) for a, b in PAIRS}
    rows = [[n, med[n] * 1e3, tokens / med[n], ratio.get(n)] for n in VARIANTS]
    comm = ranks[0]["comm"]
    moved = []
    for name in (TP_FIRST, EP_FIRST):
        per_op = comm[name]
        for key in ("tp/all_gather", "tp/reduce_scatter", "ep/all_to_all"):
            got = [r["comm"][name].get(key, {"bytes": 0})["bytes"] for r in ranks]
            moved.append(
                [name, key, per_op.get(key, {"calls": 0})["calls"], sum(got) / WORLD / MIB]
            )
    facts = {
        "ep_first step time / tp_first's, per-repeat median|.3f": 1 / ratio[EP_FIRST],
        "overlapped step time / not overlapped, per-repeat median|.3f": 1 / ratio[OVERLAP],
        "repeats run": len(times[TP_FIRST]),
        "1-minute load average, the larger of start and end|.1f": max(
            load_before, os.getloadavg()[0]
        ),
    }
    return {
        "title": "Mixture of experts: dispatch orders and the shared expert's overlap",
        "config": {"model": MOE, "variants": VARIANTS, "repeats": repeats, "budget_s": budget},
        "results": {
            "step_times_s": times,
            "median_step_s": med,
            "paired": ratio,
            "comm_per_step": {n: [r["comm"][n] for r in ranks] for n in VARIANTS},
            "first_losses": ranks[0]["first"],
        },
        "tables": [
            table(
                f"Step time, {tokens} tokens per step, 4 ranks (median over repeats)",
                [
                    "variant",
                    "step ms|,.0f",
                    "tokens/s|,.0f",
                    "speed vs its pair's other, median of per-repeat ratios|.3fx",
                ],
                rows,
            ),
            table(
                "Communication per step, mean over the 4 ranks (CommStats, timed steps)",
                ["variant", "group/op", "calls per rank|.0f", "MiB per rank|.3f"],
                moved,
            ),
        ],
        "facts": facts,
    }


if __name__ == "__main__":
    cli(run, __doc__)
