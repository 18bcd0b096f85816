"""Data parallelism and ZeRO on 2 ranks: megatronish vs torch DDP and FSDP2, scaling, memory.

A forked 2-rank gloo world (one thread per rank) holds four variants that train the same model
on the same global batches from the same initial weights: megatronish's Trainer with
``parallel.zero_stage=0`` and ``=3``, ``DistributedDataParallel`` and FSDP2 ``fully_shard``
around the plain reference GPT. A second, one-rank world trains megatronish on the same global
batch alone (two microbatches accumulated). Both worlds stay alive and their steps are timed
interleaved (``zero_worlds.py``), which gives the step-time ratios and the data-parallel scaling
efficiency. Then every ZeRO stage, DDP and FSDP2 run in fresh worlds on two larger models to
measure memory per rank, next to what megatronish's planner predicts (``zero_memory.py``).

Run alone: ``.venv/bin/python tools/bench/bench_zero.py [--quick]``.
"""

from __future__ import annotations

import math
import time

import zero_memory
import zero_optim
from common import machine_info, median, paired_ratio
from mish import bench_config, build_run
from sections import bench_cli
from zero_notes import (
    memory_findings,
    memory_method,
    optimizer_finding,
    scaling_finding,
    timing_finding,
)
from zero_peers import ddp_run, fsdp2_run, peer_setup, plain_run
from zero_tables import loss_table, memory_table, optimizer_table, scaling_table, time_table
from zero_worlds import World, interleaved_worlds, step_time

NAME = "zero"
TITLE = "Data parallelism and ZeRO, 2 ranks: megatronish vs torch DDP and FSDP2"
GLOBAL_BATCH = ["trainer.global_batch_size=16"]  # micro batch 8: one microbatch per rank at dp=2
# Memory models: wider and shorter than the timing model, so parameters, grads and Adam state
# (what ZeRO shards) outweigh activations, as in the large models ZeRO is for. One microbatch of
# 1 per rank. The large one has ~6x the parameters (and 8 blocks, so that ZeRO 3's per-block
# gathers and ZeRO 2/3's per-block buckets are a small part of the model).
MEMORY_MODEL = [
    "model.hidden_size=512", "model.num_attention_heads=8", "model.num_query_groups=4",
    "model.ffn_hidden_size=1408", "model.seq_length=64",
    "trainer.micro_batch_size=1", "trainer.global_batch_size=2",
]  # fmt: skip
MEMORY_MODEL_LARGE = [
    "model.hidden_size=1024", "model.num_attention_heads=8", "model.num_query_groups=4",
    "model.ffn_hidden_size=2816", "model.num_layers=8", "model.seq_length=64",
    "trainer.micro_batch_size=1", "trainer.global_batch_size=2",
]  # fmt: skip
MEMORY_MODELS = {"small": MEMORY_MODEL, "large": MEMORY_MODEL_LARGE}
# The training loop's own memory beside its tensors (BLAS and OpenMP workspaces, malloc arenas,
# gloo): measured on a model too small for its tensors to matter, as the RSS its zero 0 steps add
# beyond the step's planned tensors.
RUNTIME_MODEL = [
    "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.ffn_hidden_size=176", "model.num_layers=2", "model.seq_length=64",
    "trainer.micro_batch_size=1", "trainer.global_batch_size=2",
]  # fmt: skip
MEMORY_VARIANTS = ("zero 0", "zero 1", "zero 2", "zero 3", "DDP", "FSDP2")
Z0, Z3, DDP, FSDP2, SINGLE, REF1 = (
    "megatronish zero 0", "megatronish zero 3", "DDP", "FSDP2", "megatronish 1 rank",
    "reference 1 rank",
)  # fmt: skip
PEERS = {Z0: DDP, Z3: FSDP2, SINGLE: REF1}  # the 1-rank pair: the model without data parallelism
BASELINE = {Z0: SINGLE, Z3: SINGLE, DDP: REF1, FSDP2: REF1}  # whose 1-rank run each scales from


def _two_ranks(rank: int, world: int) -> dict:
    """The 2-rank variants (collective: every rank builds them in the same order)."""
    z0 = build_run([*GLOBAL_BATCH, "parallel.zero_stage=0"], rank, world)
    z3 = build_run([*GLOBAL_BATCH, "parallel.zero_stage=3"], rank, world)
    ddp = ddp_run(z0.cfg, z0.spec, z0.data, rank, world, GLOBAL_BATCH)
    fsdp = fsdp2_run(z0.cfg, z0.spec, z0.data, rank, world, GLOBAL_BATCH)
    return {Z0: z0.step, DDP: ddp.step, Z3: z3.step, FSDP2: fsdp.step}


def _one_rank(rank: int, world: int) -> dict:
    """megatronish and the plain reference GPT alone, 2 microbatches accumulated per step."""
    mish = build_run(GLOBAL_BATCH, rank, world)
    return {SINGLE: mish.step, REF1: plain_run(mish.cfg, mish.spec, mish.data, GLOBAL_BATCH).step}


def _preload() -> None:
    """Import what DDP and FSDP2 import lazily (torch._dynamo: ~10 s on a busy machine) once,
    in the parent, so forked ranks do not pay for it inside the benchmark."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401


def timing(repeats: int, steps: int) -> dict:
    """Interleaved step times and losses of every variant."""
    single = World(1, _one_rank)
    pair = World(2, _two_ranks)
    variants = {name: (pair, steps) for name in (Z0, DDP, Z3, FSDP2)}
    variants[SINGLE] = variants[REF1] = (single, steps)
    measures = interleaved_worlds(variants, repeats, warmup=1)
    losses = {**pair.close()[0]["losses"], **single.close()[0]["losses"]}
    return {"measures": measures, "losses": losses}


def scaling(measures: dict) -> dict:
    """Per 2-rank variant: wall-clock and CPU-time scaling efficiency vs the same implementation's
    one-rank run, and how the ranks' main threads spent a step (medians over repeats, means over
    ranks)."""
    out = {}
    for name, base in BASELINE.items():
        reps, one = measures[name], measures[base]
        wall = [step_time(s) / (2 * step_time(p)) for s, p in zip(one, reps, strict=True)]
        cpu = [
            s[0]["process_cpu"] / sum(r["process_cpu"] for r in p)
            for s, p in zip(one, reps, strict=True)
        ]
        out[name] = {"wall": median(wall), "cpu": median(cpu)}
    for name, reps in measures.items():
        out.setdefault(name, {})["main_thread"] = {
            k: median([sum(r[k] for r in ranks) / len(ranks) for ranks in reps])
            for k in ("on_cpu", "cpu_wait", "blocked", "process_cpu")
        }
    return out


def model_label(overrides: list[str]) -> str:
    """The model shape of the benchmark config with ``overrides``, in words."""
    m = bench_config(overrides).model
    return (
        f"hidden {m.hidden_size}, {m.num_attention_heads} heads, {m.num_query_groups} kv heads, "
        f"ffn {m.ffn_hidden_size}, {m.num_layers} layers, vocab {m.vocab_size}, seq {m.seq_length}"
    )


def runtime_bytes(steps: int) -> int:
    """RSS the training steps of ``RUNTIME_MODEL`` add beyond their planned tensors (the lower
    median over its ranks)."""
    extra = sorted(
        (r["rss_peak"] - r["rss_built"]) - (r["plan"]["peak"] - r["plan"]["states_total"])
        for r in zero_memory.measure("zero 0", RUNTIME_MODEL, steps)
    )
    return extra[(len(extra) - 1) // 2]


def memory(steps: int, models: dict[str, list[str]] | None = None) -> dict:
    """Per model (default ``MEMORY_MODELS``): its overrides, shape, the per-rank memory reports
    of every ZeRO stage and both peers (a fresh world each), the seconds they took, and the
    runtime's own bytes (:func:`runtime_bytes`, measured once)."""
    runtime = runtime_bytes(steps)
    out = {}
    for name, overrides in (models or MEMORY_MODELS).items():
        t0 = time.perf_counter()
        variants = {v: zero_memory.measure(v, overrides, steps) for v in MEMORY_VARIANTS}
        out[name] = {
            "overrides": overrides,
            "label": model_label(overrides),
            "steps": steps,
            "variants": variants,
            "runtime": runtime,
            "seconds": time.perf_counter() - t0,
        }
    return out


def memory_tables(mem: dict) -> list[dict]:
    """One memory table per model of :func:`memory`."""
    return [
        memory_table(
            f"{name} model ({m['label']})", m["variants"], zero_memory.zero_formula, m["runtime"]
        )  # fmt: skip
        for name, m in mem.items()
    ]


def run(quick: bool = False) -> dict:
    """The section result (see ``sections.py``)."""
    t0 = time.perf_counter()
    _preload()
    repeats, steps = (3, 1) if quick else (7, 1)
    timed = timing(repeats, steps)
    mem = memory(2)
    optim = zero_optim.measure(GLOBAL_BATCH)
    cfg, spec, _ = peer_setup(GLOBAL_BATCH)
    tokens = cfg.trainer.global_batch_size * spec.seq_length
    measures, losses = timed["measures"], timed["losses"]
    times = {n: [step_time(ranks) for ranks in reps] for n, reps in measures.items()}
    med = {n: median(ts) for n, ts in times.items()}
    ratios = {n: paired_ratio(times[n], times[p]) for n, p in PEERS.items()}
    cpu = {
        n: [sum(r["process_cpu"] for r in ranks) for ranks in reps] for n, reps in measures.items()
    }
    cpu_ratios = {n: paired_ratio(cpu[n], cpu[p]) for n, p in PEERS.items()}
    efficiency = scaling(measures)
    method = (
        f"Two forked gloo ranks, one intra-op thread each, fp32. Timing model: the tiny llama "
        f"(4 layers, hidden {spec.hidden_size}, 4 heads, 2 kv heads, ffn 352, vocab 4096, seq "
        f"{spec.seq_length}), global batch {cfg.trainer.global_batch_size} = micro batch "
        f"{cfg.trainer.micro_batch_size} per rank ({tokens} tokens per step), AdamW (decay on "
        f"matrices only), clip {cfg.optimizer.grad_clip}, constant lr, all from megatronish's "
        f"initial weights on the same synthetic batches. DDP (default 25 MB buckets) and FSDP2 "
        f"(`fully_shard` on every block, then the root, 1-D CPU mesh) wrap the plain reference "
        f"GPT (`reference_gpt.py`, fused q|k|v and gate|up) with `torch.optim.AdamW(fused=True)`"
        f" and "
        f"`clip_grad_norm_`. A one-rank world trains megatronish and the reference GPT on the "
        f"same global batch (2 microbatches accumulated) for the scaling efficiency = tokens/s "
        f"with 2 ranks / (2 x tokens/s of the same implementation with 1), and its CPU-time "
        f"analogue = process CPU seconds per step with "
        f"1 rank / the sum over the 2 ranks (all threads, `time.process_time`). Both worlds "
        f"stay alive and take turns: {repeats} interleaved repeats of {steps} step(s) per "
        f"variant after 1 warm-up step, barrier before each, a repeat's time is the slower "
        f"rank's; medians, and medians of per-repeat ratios."
    )
    notes = [
        timing_finding(times, cpu_ratios, PEERS),
        optimizer_finding(optim, efficiency[Z0]["main_thread"]["on_cpu"] * 1000),
        scaling_finding(efficiency, Z0, SINGLE),
        memory_method(mem),
        *memory_findings(mem),
        f"ln(vocab) = {math.log(4096):.4f}.",
    ]
    tables = [
        time_table(med, ratios, cpu_ratios, tokens, PEERS),
        scaling_table(med, efficiency, tokens),
        loss_table(losses, Z0),
        *memory_tables(mem),
        optimizer_table(optim),
    ]
    return {
        "name": NAME,
        "title": TITLE,
        "method": method,
        "quick": quick,
        "tables": tables,
        "notes": notes,
        "raw": {
            "step_times_s": times,
            "measures": measures,
            "median_step_s": med,
            "paired_ratios": ratios,
            "paired_cpu_ratios": cpu_ratios,
            "scaling_efficiency": efficiency,
            "losses": losses,
            "memory": mem,
            "optimizer_ms": optim,
            "tokens_per_step": tokens,
        },
        "seconds": time.perf_counter() - t0,
        "machine": machine_info(),
    }


def main() -> None:
    bench_cli(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
