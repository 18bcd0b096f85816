"""Data parallelism for slow links and small GPUs on CPU: hybrid sharding, gradient compression
(PowerSGD, int8) and optimizer offload side by side with plain ZeRO in one 4-rank world; the
bytes each sends per step against the planner's; what compressing costs against the bytes it
saves; and 300-step loss curves on the built-in corpus with and without compression.
Run alone: ``.venv/bin/python tools/bench/dp_comm.py [--quick]``.
"""

from __future__ import annotations

import time

import torch
from common import BENCH_OVERRIDES, build_run, cli, median, paired_ratio, table
from zero import World, step_time

from megatronish.config.compose import load_config
from megatronish.data.gpt_dataset import GPTDataset
from megatronish.data.indexed import IndexedDataset
from megatronish.data.stdlib_corpus import ensure_stdlib_corpus
from megatronish.data_parallel.compression import CompressionSettings, make_compressor
from megatronish.distributed.comm import single_group
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer

WORLD = 4
BATCH = ["trainer.micro_batch_size=4", "trainer.global_batch_size=32"]  # 2 microbatches a rank
VARIANTS = {
    "zero 1": ["parallel.zero_stage=1"],
    "zero 1 + powersgd/4": ["parallel.zero_stage=1", "parallel.grad_compression=powersgd"],
    "zero 1 + powersgd/4+vocab": [
        "parallel.zero_stage=1",
        "parallel.grad_compression=powersgd",
        "parallel.powersgd_compress_vocab=true",
    ],
    "zero 1 + int8": ["parallel.zero_stage=1", "parallel.grad_compression=int8"],
    "zero 1 + offload": ["parallel.zero_stage=1", "parallel.optimizer_offload=true"],
    "zero 3": ["parallel.zero_stage=3"],
    "zero 3, hybrid S=2": ["parallel.zero_stage=3", "parallel.zero_shard_size=2"],
    "zero 3 + int8": ["parallel.zero_stage=3", "parallel.grad_compression=int8"],
}
PLAIN = {"zero 1": "zero 1", "zero 3": "zero 3"}  # each variant's uncompressed baseline
POWERSGD = ["parallel.grad_compression=powersgd"]
CURVES = {
    "uncompressed": [],
    "powersgd rank 4": [*POWERSGD, "parallel.powersgd_rank=4"],
    "powersgd rank 8": [*POWERSGD, "parallel.powersgd_rank=8"],
    "powersgd rank 8, from step 30": [
        *POWERSGD,
        "parallel.powersgd_rank=8",
        "parallel.grad_compression_start_step=30",
    ],
    "powersgd rank 4, vocabulary compressed too": [
        *POWERSGD,
        "parallel.powersgd_rank=4",
        "parallel.powersgd_compress_vocab=true",
    ],
    "int8": ["parallel.grad_compression=int8"],
}
CURVE_STEPS = 300
CURVE_BATCH = ["trainer.micro_batch_size=8", "trainer.global_batch_size=16"]  # one microbatch
CACHE = "~/.cache/megatronish"


def baseline(name: str) -> str:
    return "zero 3" if name.startswith("zero 3") else "zero 1"


def _variants(rank: int, world: int) -> dict:
    runs = {name: build_run([*BATCH, *extra], rank, world) for name, extra in VARIANTS.items()}
    return {name: run.step for name, run in runs.items()}


def timing(repeats: int) -> dict[str, list[float]]:
    """Seconds per step of every variant, interleaved repeats in one 4-rank world."""
    world = World(WORLD, _variants)
    for name in VARIANTS:
        world.time(name, 1)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(repeats):
        for name in VARIANTS if r % 2 == 0 else reversed(list(VARIANTS)):
            times[name].append(step_time(world.time(name, 1)))
    world.close()
    return times


def _bytes(rank: int, world: int, extra: list[str]) -> dict:
    run = build_run([*BATCH, *extra], rank, world)
    run.step()
    stats = run.trainer.topo.stats
    stats.reset()
    run.step()
    summary = stats.summary()
    dp = {k: v["bytes"] for k, v in summary.items() if not k.startswith(("world/", "mp/"))}
    dp["dp/all_reduce"] -= 4  # the step's mean loss (one fp32), not planned
    dp = {k: b for k, b in dp.items() if b}
    planned = make_plan(spec_of(run.cfg), layout_from_config(run.cfg, world)).stages[0].comm
    return {"measured": dp, "planned": {k: b for k, (_, b) in planned.items()}}


def traffic() -> dict[str, dict]:
    """Per variant, rank 0's bytes per step by group/op, measured and planned."""
    return {name: run_world(_bytes, WORLD, [*BATCH, *extra])[0] for name, extra in VARIANTS.items()}


def codec_costs(repeats: int) -> dict[str, dict]:
    """Each codec's compute per step on the tiny model's buckets (thread CPU ms, one thread, a
    group of one: the arithmetic of a rank, which quantizes and dequantizes a whole bucket in a
    world of any size, without the exchange)."""
    out = {}
    torch.set_num_threads(1)
    run = build_run(BATCH)
    buckets = run.trainer.zero.buckets
    for b in buckets:
        b.dp = WORLD  # reduced over more than one rank, as in the 4-rank world: compressed
    for kind in ("powersgd", "int8"):
        codec = make_compressor(CompressionSettings(kind, powersgd_rank=4), buckets, seed=0)
        group = single_group("dp")
        grads = [torch.randn(b.numel) for b in buckets]
        times = []
        for _ in range(repeats):
            t0 = time.thread_time()
            for b, g in zip(buckets, grads):
                full = g.clone()
                reduction = codec.launch(b, full, full, False, group)
                reduction.advance()
                reduction.finish()
            times.append((time.thread_time() - t0) * 1000)
        out[kind] = {"ms": median(times), "elements": sum(b.numel for b in buckets)}
    return out


def _schedule(steps: int) -> list[str]:
    """A pretraining schedule: linear warm-up over the first tenth, cosine decay to the end."""
    return ["scheduler.style=cosine", f"scheduler.warmup_steps={max(1, steps // 10)}"]


def _curve(rank: int, world: int, extra: list[str], steps: int) -> list[float]:
    prefix, _ = ensure_stdlib_corpus(CACHE, 4096, 8.0)
    t = build_trainer(
        rank,
        world,
        ["parallel.zero_stage=1", *CURVE_BATCH, *_schedule(steps), *extra],
        steps,
        model=[*BENCH_OVERRIDES, f"trainer.max_steps={steps}"],
    )
    t.train_data = GPTDataset(IndexedDataset(prefix), t.cfg.model.seq_length, seed=1234)
    return [r.loss for r in t.fit()]


def curves(steps: int) -> dict[str, list[float]]:
    """Loss per step of each compression on 2 dp ranks, the built-in corpus, the same batches."""
    return {
        name: run_world(_curve, 2, extra, steps, timeout=1800)[0] for name, extra in CURVES.items()
    }


def run(quick: bool = False) -> dict:
    repeats = 3 if quick else 7
    steps = 30 if quick else CURVE_STEPS
    times = timing(repeats)
    sent = traffic()
    costs = codec_costs(3 if quick else 7)
    losses = curves(steps)
    med = {n: median(ts) for n, ts in times.items()}
    ratio = {n: paired_ratio(times[n], times[baseline(n)]) for n in times}
    dp_bytes = {n: sum(v["measured"].values()) for n, v in sent.items()}
    reduced = {  # the grads' reductions: what compression shrinks (not the param gathers)
        n: sum(b for k, b in v["measured"].items() if not k.endswith("/all_gather"))
        for n, v in sent.items()
    }
    exact = {n: v["measured"] == v["planned"] for n, v in sent.items()}
    ref = losses["uncompressed"]
    tail = max(1, steps // 10)  # the last tenth of the run, averaged (less batch noise)
    mean_tail = {n: sum(ls[-tail:]) / tail for n, ls in losses.items()}
    cfg = load_config([*BENCH_OVERRIDES, *CURVE_BATCH])
    saved = {
        kind: reduced["zero 1"] - reduced[name]
        for kind, name in (("powersgd", "zero 1 + powersgd/4"), ("int8", "zero 1 + int8"))
    }
    break_even = {k: saved[k] / (costs[k]["ms"] / 1000) / 1e9 for k in costs}
    return {
        "title": "Data parallelism for slow links: hybrid sharding, compression, offload (4 ranks)",
        "config": {"world": WORLD, "batch": BATCH, "repeats": repeats, "curve_steps": steps},
        "results": {
            "step_times_s": times,
            "traffic": sent,
            "codec_costs": costs,
            "losses": losses,
        },
        "tables": [
            table(
                "Step time side by side, one 4-rank world, interleaved (median; ratio: median of "
                "per-repeat ratios to the plain stage). Two cores under four ranks hide no "
                "transfer: the ratios say what each feature costs in compute here, not what "
                "it saves on a slow link (the planner's tables in docs/parallelism.md do)",
                [
                    "variant",
                    "step ms|.0f",
                    "vs plain|.2fx",
                    "dp bytes per step, rank 0|,.0f",
                    "of them grad reductions|,.0f",
                    "reduction bytes: fewer than plain|.2fx",
                    "CommStats == plan",
                ],
                [
                    [
                        n,
                        med[n] * 1e3,
                        ratio[n],
                        dp_bytes[n],
                        reduced[n],
                        reduced[baseline(n)] / reduced[n],
                        exact[n],
                    ]
                    for n in VARIANTS
                ],
            ),
            table(
                "What compressing costs: the codec's compute per step on the tiny model's "
                "buckets (one thread) against the bytes it saves; a link slower than the "
                "break-even bandwidth gains from it",
                ["codec", "ms per step|.1f", "bytes saved per step|,.0f", "break-even GB/s|.2f"],
                [[k, costs[k]["ms"], saved[k], break_even[k]] for k in costs],
            ),
            table(
                f"Loss on the built-in corpus, 2 dp ranks, ZeRO 1, {steps} steps, the same batches",
                [
                    "run",
                    "step 1|.4f",
                    f"step {steps // 2}|.4f",
                    f"step {steps}|.4f",
                    f"mean of the last {tail}|.4f",
                    "vs uncompressed|+.2%",
                ],
                [
                    [
                        n,
                        ls[0],
                        ls[steps // 2 - 1],
                        ls[-1],
                        mean_tail[n],
                        mean_tail[n] / mean_tail["uncompressed"] - 1,
                    ]
                    for n, ls in losses.items()
                ],
            ),
        ],
        "facts": {
            "every variant's bytes equal the planner's|": all(exact.values()),
            "grad reduction bytes, zero 1 / powersgd rank 4, x|.1f": reduced["zero 1"]
            / reduced["zero 1 + powersgd/4"],
            "grad reduction bytes, zero 1 / powersgd rank 4 with the vocabulary, x|.1f": reduced[
                "zero 1"
            ]
            / reduced["zero 1 + powersgd/4+vocab"],
            "grad reduction bytes, zero 1 / int8, x|.2f": reduced["zero 1"]
            / reduced["zero 1 + int8"],
            f"final-tenth loss vs uncompressed after {steps} steps: powersgd 4 / 8 / int8|+.2%": [
                mean_tail[n] / mean_tail["uncompressed"] - 1
                for n in ("powersgd rank 4", "powersgd rank 8", "int8")
            ],
            "tokens per step of the loss curves|,.0f": cfg.trainer.global_batch_size
            * cfg.model.seq_length,
            "uncompressed loss, first / last step|.4f": [ref[0], ref[-1]],
        },
    }


if __name__ == "__main__":
    cli(run, __doc__)
