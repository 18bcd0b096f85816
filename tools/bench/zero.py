"""Data parallelism and ZeRO on 2 ranks: megatronish vs torch DDP and FSDP2, data-parallel
scaling, memory per rank, optimizer-side work. Run: ``.venv/bin/python tools/bench/zero.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import multiprocessing as mp
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import MIB, build_run, cli, config, median, paired_ratio, reference_run, table, threads
from torch import nn

from megatronish.config.schema import TrainConfig
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.spec import ModelSpec
from megatronish.testing.multiproc import run_world
from megatronish.testing.synthetic import PatternTokens

GLOBAL_BATCH = ["trainer.global_batch_size=16"]  # micro batch 8: one microbatch per rank at dp=2
# Memory models: wider and shorter than the timing model, so that parameters, grads and Adam
# state outweigh activations; the large one has ~6x the parameters and 8 blocks.
ONE_MICROBATCH = [
    "model.seq_length=64",
    "trainer.micro_batch_size=1",
    "trainer.global_batch_size=2",
]
MEMORY_MODELS = {
    "small": [
        "model.hidden_size=512",
        "model.num_attention_heads=8",
        "model.num_query_groups=4",
        "model.ffn_hidden_size=1408",
        *ONE_MICROBATCH,
    ],
    "large": [
        "model.hidden_size=1024",
        "model.num_attention_heads=8",
        "model.num_query_groups=4",
        "model.ffn_hidden_size=2816",
        "model.num_layers=8",
        *ONE_MICROBATCH,
    ],
}
# Too small for its tensors to matter: the RSS its steps add beyond them is the runtime's own.
RUNTIME_MODEL = [
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=176",
    "model.num_layers=2",
    *ONE_MICROBATCH,
]
MEMORY_VARIANTS = ("zero 0", "zero 1", "zero 2", "zero 3", "DDP", "FSDP2")
STAGES = MEMORY_VARIANTS[:4]
FORMULA = {
    0: ("16Ψ", 16, 0),
    1: ("8Ψ + 8Ψ/dp", 8, 8),
    2: ("4Ψ + 12Ψ/dp", 4, 12),
    3: ("16Ψ/dp", 0, 16),
    "DDP": ("16Ψ", 16, 0),
    "FSDP2": ("16Ψ/dp", 0, 16),
}
Z0, Z3, DDP, FSDP2 = "megatronish zero 0", "megatronish zero 3", "DDP", "FSDP2"
SINGLE, REF1 = "megatronish 1 rank", "reference 1 rank"
PEERS = {Z0: DDP, Z3: FSDP2, SINGLE: REF1}  # the 1-rank pair: the model without data parallelism
BASELINE = {Z0: SINGLE, Z3: SINGLE, DDP: REF1, FSDP2: REF1}  # whose 1-rank run each scales from
OPTIM = (
    "megatronish ShardedAdamW.step",
    "torch.optim.AdamW.step (per-parameter loop)",
    "torch._fused_adamw_, one call over the whole shards",
    "megatronish ZeroDataParallel.grad_norm",
    "torch clip_grad_norm_",
)


def peer(kind: str, rank: int, world: int, extra: list[str], mish=None):
    """The reference GPT under ``DDP``, ``FSDP2`` (``fully_shard`` on every block, then the
    root) or alone (``plain``, accumulating microbatches), on ``mish``'s config and data (or the
    benchmark config with ``extra``, building no megatronish model)."""
    if mish is None:
        cfg = config(extra)
        spec = ModelSpec.from_config(cfg.model, cfg.model.vocab_size)
        data = PatternTokens(spec.vocab_size, spec.seq_length, seed=cfg.trainer.seed)
    else:
        cfg, spec, data = mish.cfg, mish.spec, mish.data
    wrap, micro = None, cfg.trainer.micro_batch_size if kind == "plain" else None
    if kind == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))

        def wrap(model: nn.Module) -> nn.Module:
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            return fully_shard(model, mesh=mesh)
    elif kind == "DDP":
        wrap = nn.parallel.DistributedDataParallel
    return reference_run(cfg, spec, data, extra, wrap, rank=rank, world=world, micro_batch=micro)


def _two_ranks(rank: int, world: int) -> dict:
    z0 = build_run([*GLOBAL_BATCH, "parallel.zero_stage=0"], rank, world)
    z3 = build_run([*GLOBAL_BATCH, "parallel.zero_stage=3"], rank, world)
    ddp, fsdp = (peer(k, rank, world, GLOBAL_BATCH, z0) for k in (DDP, FSDP2))
    return {Z0: z0.step, DDP: ddp.step, Z3: z3.step, FSDP2: fsdp.step}


def _one_rank(rank: int, world: int) -> dict:
    mish = build_run(GLOBAL_BATCH, rank, world)
    return {SINGLE: mish.step, REF1: peer("plain", 0, 1, GLOBAL_BATCH, mish).step}


def _schedstat() -> tuple[float, float]:
    """Seconds this thread spent on a CPU and waiting for one (zeros where unavailable)."""
    with contextlib.suppress(OSError, ValueError):
        on_cpu, waiting, _ = Path("/proc/thread-self/schedstat").read_text().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    return 0.0, 0.0


def _serve(rank: int, world: int, builder, commands, results) -> dict:
    """One rank of a :class:`World`: build the variants, then time steps on command; per step
    its wall, process CPU and main-thread on-CPU / waiting / blocked seconds."""
    steppers = builder(rank, world)
    losses: dict[str, list[float]] = {name: [] for name in steppers}
    results.put(("ready", rank, None))
    while (command := commands[rank].get()) is not None:
        name, steps = command
        if world > 1:
            dist.barrier()
        t0, cpu0, (on0, wait0) = time.perf_counter(), time.process_time(), _schedstat()
        for _ in range(steps):
            losses[name].append(steppers[name]())
        wall, cpu, (on1, wait1) = time.perf_counter() - t0, time.process_time() - cpu0, _schedstat()
        on, waiting = on1 - on0, wait1 - wait0
        per_step = {
            "wall": wall,
            "process_cpu": cpu,
            "on_cpu": on,
            "cpu_wait": waiting,
            "blocked": wall - on - waiting,
        }
        results.put((name, rank, {k: v / steps for k, v in per_step.items()}))
    if world > 1:
        dist.barrier()  # ranks leave together (a rank exiting early can hang gloo shutdown)
    return {"losses": losses}


class World:
    """A forked gloo world that stays alive and times steps of ``builder``'s variants on
    command (ranks block on a pipe meanwhile), so that worlds of different sizes take turns."""

    def __init__(self, size: int, builder):
        ctx = mp.get_context("fork")
        self.commands = [ctx.SimpleQueue() for _ in range(size)]
        self.results, self.outcome = ctx.SimpleQueue(), None

        def target() -> None:
            try:
                self.outcome = run_world(
                    _serve,
                    size,
                    builder,
                    self.commands,
                    self.results,
                    timeout=1800,
                    collective_timeout=600,
                )
            except BaseException as exc:  # noqa: BLE001 - reported by the waiting parent
                self.outcome = exc
                self.results.put(("failed", -1, None))

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()
        self._collect("ready")

    def _collect(self, expected: str) -> list:
        values: list = [None] * len(self.commands)
        for _ in self.commands:
            name, rank, value = self.results.get()
            if name != expected:
                raise RuntimeError(f"expected {expected!r}, got {name!r}: {self.outcome}")
            values[rank] = value
        return values

    def time(self, name: str, steps: int) -> list[dict[str, float]]:
        """Each rank's measures per step of ``steps`` steps of variant ``name``."""
        for q in self.commands:
            q.put((name, steps))
        return self._collect(name)

    def close(self) -> dict:
        """Stop the ranks; rank 0's losses per variant."""
        for q in self.commands:
            q.put(None)
        self.thread.join()
        if isinstance(self.outcome, BaseException):
            raise RuntimeError("world failed") from self.outcome
        return self.outcome[0]["losses"]


def step_time(ranks: list[dict[str, float]]) -> float:
    return max(r["wall"] for r in ranks)


def timing(repeats: int, steps: int, warmup: int = 1) -> tuple[dict, dict]:
    """Per variant and repeat each rank's measures (the two worlds interleaved), and losses."""
    single, pair = World(1, _one_rank), World(2, _two_ranks)
    variants = {name: pair for name in (Z0, DDP, Z3, FSDP2)} | {SINGLE: single, REF1: single}
    for name, world in variants.items():
        world.time(name, warmup)
    measures: dict[str, list] = {n: [] for n in variants}
    for r in range(repeats):
        for name in variants if r % 2 == 0 else reversed(variants):
            measures[name].append(variants[name].time(name, steps))
    return measures, {**pair.close(), **single.close()}


def scaling(measures: dict) -> dict:
    """Wall-clock and CPU-time scaling efficiency of each 2-rank variant against the same
    implementation's 1 rank, and where the main threads spent a step (medians, rank means)."""
    out = {}
    for name, base in BASELINE.items():
        pairs = list(zip(measures[base], measures[name], strict=True))
        cpu = [s[0]["process_cpu"] / sum(r["process_cpu"] for r in p) for s, p in pairs]
        out[name] = {
            "wall": median([step_time(s) / (2 * step_time(p)) for s, p in pairs]),
            "cpu": median(cpu),
        }
    for name, reps in measures.items():
        out.setdefault(name, {})["main_thread"] = {
            k: median([sum(r[k] for r in ranks) / len(ranks) for ranks in reps])
            for k in ("on_cpu", "cpu_wait", "blocked", "process_cpu")
        }
    return out


def _status_bytes(field: str) -> int:
    lines = Path("/proc/self/status").read_text().splitlines()
    return next((int(x.split()[1]) * 1024 for x in lines if x.startswith(field + ":")), 0)


def _reset_peak() -> bool:
    """Set VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
        return True
    return False


def planned(cfg: TrainConfig, world: int) -> dict[str, int]:
    """The planner's bytes for one rank of ``cfg`` on ``world`` ranks (pp = 1: stage 0)."""
    stage = make_plan(spec_of(cfg), layout_from_config(cfg, world)).stages[0]
    s = stage.states
    keys = ("params", "grads", "optimizer", "params_step", "grads_step", "grads_at_peak")
    return {
        **{k: getattr(s, k) for k in keys},
        "peak": stage.peak,
        "states_total": s.total,
        "activations_peak": stage.activations.peak,
        "optimizer_workspace": stage.optimizer_workspace,
    }


def _memory_rank(rank: int, world: int, variant: str, extra: list[str], steps: int) -> dict:
    """Build ``variant`` in a fresh world, train ``steps`` steps, report RSS and state bytes."""
    libc = None
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL("libc.so.6")
    # Every allocation of 256 KiB or more gets its own mapping, so RSS follows tensor frees
    # (glibc would otherwise raise its mmap threshold after the first large free).
    exact = bool(libc and libc.mallopt(-3, 256 * 1024) and libc.mallopt(-1, 256 * 1024))
    out: dict = {"reset_peak": _reset_peak(), "exact_rss": exact}
    out["rss_start"] = _status_bytes("VmRSS")
    if variant.startswith("zero"):
        run = build_run([*extra, f"parallel.zero_stage={variant.split()[1]}"], rank, world)
        step, zero = run.step, run.trainer.zero
        out["psi"] = sum(p.numel() for c in run.chunks for p in c.parameters())
    else:
        step, zero = peer(variant, rank, world, extra).step, None
    gc.collect()
    if libc is not None:
        libc.malloc_trim(0)  # hand freed build-time memory (initial weight copies) back
    out["rss_built"] = _status_bytes("VmRSS")
    _reset_peak()  # the peak of the training steps only
    out["losses"] = [step() for _ in range(steps)]
    out["rss_peak"] = _status_bytes("VmHWM")
    if zero is not None:
        out["state"] = {**zero.state_bytes(), "optimizer": run.trainer.optimizer.state_bytes()}
        # Weight-decay and grad-norm selections are (start, end) ranges: two ints per range.
        out["masks"] = sum(16 * (len(b.decay_ranges) + len(b.norm_ranges)) for b in zero.buckets)
        out["plan"] = planned(run.cfg, world)  # after the peak is read: meta tensors only
    return out


def memory(steps: int) -> dict:
    """Per memory model every variant's per-rank reports (a fresh world each) and the seconds
    they took, with the runtime's own bytes (the lower median over ranks, measured once)."""

    def measure(variant: str, extra: list[str]) -> list[dict]:
        return run_world(
            _memory_rank, 2, variant, extra, steps, timeout=600, collective_timeout=300
        )

    extra = sorted(
        r["rss_peak"] - r["rss_built"] - r["plan"]["peak"] + r["plan"]["states_total"]
        for r in measure("zero 0", RUNTIME_MODEL)
    )
    out = {}
    for name, overrides in MEMORY_MODELS.items():
        t0 = time.perf_counter()
        variants = {v: measure(v, overrides) for v in MEMORY_VARIANTS}
        m = config(overrides).model
        label = (
            f"hidden {m.hidden_size}, {m.num_attention_heads} heads, {m.num_query_groups} kv "
            f"heads, ffn {m.ffn_hidden_size}, {m.num_layers} layers, vocab {m.vocab_size}, "
            f"seq {m.seq_length}"
        )
        out[name] = {
            "overrides": overrides,
            "label": label,
            "steps": steps,
            "variants": variants,
            "runtime": extra[(len(extra) - 1) // 2],
            "seconds": time.perf_counter() - t0,
        }
    return out


def memory_table(name: str, m: dict) -> tuple[dict, dict]:
    """One model's table (state vs ZeRO's formulas, RSS, the planner) and its facts."""
    v = m["variants"]
    psi, dp = v["zero 0"][0]["psi"], len(v["zero 0"])
    peak = {k: max(x["rss_peak"] - x["rss_start"] for x in ranks) / MIB for k, ranks in v.items()}
    plan = {k: (v[k][0]["plan"]["peak"] + m["runtime"]) / MIB for k in STAGES}
    rows = []
    for variant, ranks in v.items():
        label, full, sharded = FORMULA[int(variant[-1]) if variant in STAGES else variant]
        s = ranks[0].get("state")
        state = [s["params"], s["grads"], s["optimizer"]] if s else []
        state = [x / MIB for x in [*state, sum(state)]] if s else [None] * 4
        built = max(x["rss_built"] - x["rss_start"] for x in ranks) / MIB
        ratio = peak[variant] / plan[variant] if variant in plan else None
        rows.append(
            [
                variant if variant not in STAGES else f"megatronish {variant}",
                *state,
                label,
                (full + sharded / dp) * psi / MIB,
                built,
                peak[variant],
                plan.get(variant),
                ratio,
            ]
        )
    over, ratio = [peak[k] - plan[k] for k in STAGES], [peak[k] / plan[k] for k in STAGES]
    cols = [
        "variant",
        "params|.1f",
        "grads|.1f",
        "Adam state|.1f",
        "state total|.1f",
        "ZeRO formula",
        "formula|.1f",
        "RSS after build, above start|.0f",
        "peak RSS in steps, above start|.0f",
        "planned peak + runtime|.0f",
        "measured / planned|.2f",
    ]
    caption = (
        f"Memory per rank (MiB), {name} model ({m['label']}): Ψ = {psi / 1e6:.2f} M, dp = {dp}"
    )
    return table(caption, cols, rows), {
        f"{name} model: peak RSS of zero 0 > 1 > 2 > 3, strictly decreasing": all(
            peak[a] > peak[b] for a, b in zip(STAGES, STAGES[1:])
        ),
        f"{name} model: zero 3 / FSDP2 peak RSS|.2fx": peak["zero 3"] / peak["FSDP2"],
        f"{name} model: measured / (planned + runtime), lowest / highest|.2f": [
            min(ratio),
            max(ratio),
        ],
        f"{name} model: measured - (planned + runtime), lowest / highest, MiB|.0f": [
            min(over),
            max(over),
        ],
    }


def optimizer_times(extra: list[str], repeats: int = 7, calls: int = 10) -> dict[str, float]:
    """Median thread-CPU milliseconds per call of the optimizer-side candidates (1 thread)."""
    with threads(1):
        mish = build_run(extra)
        ref = peer("plain", 0, 1, extra, mish)
        mish.step(), ref.step()  # grads and optimizer state exist from here on
        zero, opt, o = mish.trainer.zero, mish.trainer.optimizer, mish.cfg.optimizer
        shards = zero.optimizer_shards()
        flat, grads = [s[0].detach().clone() for s in shards], [s[1] for s in shards]
        moments = [torch.zeros_like(t) for t in flat], [torch.zeros_like(t) for t in flat]
        counts = [torch.zeros(()) for _ in flat]
        params = [p for p in ref.model.parameters() if p.grad is not None]

        def fused() -> None:  # one call over the whole shards, decay everywhere: a cost bound
            for c in counts:
                c += 1
            torch._fused_adamw_(
                flat,
                grads,
                *moments,
                [],
                counts,
                amsgrad=False,
                lr=o.lr,
                beta1=o.beta1,
                beta2=o.beta2,
                weight_decay=o.weight_decay,
                eps=o.eps,
                maximize=False,
            )

        clip = lambda: torch.nn.utils.clip_grad_norm_(params, 1e9)
        fns = (lambda: opt.step(shards, o.lr), ref.optimizer.step, fused, zero.grad_norm, clip)
        candidates = dict(zip(OPTIM, fns, strict=True))
        times: dict[str, list[float]] = {n: [] for n in candidates}
        for r in range(repeats):
            for name in candidates if r % 2 == 0 else reversed(candidates):
                t0 = time.thread_time()
                for _ in range(calls):
                    candidates[name]()
                times[name].append((time.thread_time() - t0) / calls * 1000)
    return {n: median(ts) for n, ts in times.items()}


def run(quick: bool = False) -> dict:
    import torch._dynamo  # noqa: F401 - DDP and FSDP2 import it lazily (slow), once, before forks
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    repeats, steps = (3, 1) if quick else (7, 1)
    measures, losses = timing(repeats, steps)
    mem = memory(2)
    optim = optimizer_times(GLOBAL_BATCH)
    cfg = config(GLOBAL_BATCH)
    tokens = cfg.trainer.global_batch_size * cfg.model.seq_length
    times = {n: [step_time(ranks) for ranks in reps] for n, reps in measures.items()}
    cpu = {
        n: [sum(r["process_cpu"] for r in ranks) for ranks in reps] for n, reps in measures.items()
    }
    med = {n: median(ts) for n, ts in times.items()}
    ratios = {n: paired_ratio(times[n], times[p]) for n, p in PEERS.items()}
    cpu_ratios = {n: paired_ratio(cpu[n], cpu[p]) for n, p in PEERS.items()}
    per_repeat = {n: sorted(a / b for a, b in zip(times[n], times[p])) for n, p in PEERS.items()}
    quartiles = {n: [xs[len(xs) // 4], xs[(3 * len(xs)) // 4]] for n, xs in per_repeat.items()}
    eff = scaling(measures)
    scale_rows = []
    for n, s in sorted(eff.items(), key=lambda kv: "wall" in kv[1]):
        t = s["main_thread"]
        split = [t[k] * 1e3 for k in ("on_cpu", "cpu_wait", "blocked")]
        scale_rows.append(
            [
                n,
                2 if "wall" in s else 1,
                med[n] * 1e3,
                tokens / med[n],
                s.get("wall"),
                s.get("cpu"),
                t["process_cpu"] * 1e3,
                split,
                split[1] / sum(split),
            ]
        )
    mem_tables, mem_facts = zip(*(memory_table(name, m) for name, m in mem.items()), strict=True)
    plan3 = mem["large"]["variants"]["zero 3"][0]["plan"]
    masks = max(r["masks"] for m in mem.values() for k in STAGES for r in m["variants"][k])
    saved = optim[OPTIM[1]] + optim[OPTIM[4]] - optim[OPTIM[0]] - optim[OPTIM[3]]
    return {
        "title": "Data parallelism and ZeRO, 2 ranks: megatronish vs torch DDP and FSDP2",
        "config": {
            "repeats": repeats,
            "steps_per_repeat": steps,
            "warmup": 1,
            "global_batch": GLOBAL_BATCH,
            "memory_models": MEMORY_MODELS,
            "runtime_model": RUNTIME_MODEL,
            "memory_steps": 2,
        },
        "results": {
            "step_times_s": times,
            "measures": measures,
            "median_step_s": med,
            "paired_ratios": ratios,
            "paired_cpu_ratios": cpu_ratios,
            "ratio_quartiles": quartiles,
            "scaling_efficiency": eff,
            "losses": losses,
            "memory": mem,
            "optimizer_ms": optim,
            "tokens_per_step": tokens,
        },
        "tables": [
            table(
                "Step time (median over repeats; target: megatronish <= 1.00x its peer)",
                [
                    "variant",
                    "step ms|.0f",
                    "tokens/s|,.0f",
                    "peer",
                    "step time / peer's|.2fx",
                    "median of per-repeat ratios|.2fx",
                    "per-repeat ratios, lower / upper quartile|.2fx",
                    "CPU time / peer's (all ranks and threads, median of per-repeat ratios)|.2fx",
                ],
                [
                    [
                        n,
                        med[n] * 1e3,
                        tokens / med[n],
                        PEERS.get(n),
                        med[n] / med[PEERS[n]] if n in PEERS else None,
                        ratios.get(n),
                        quartiles.get(n),
                        cpu_ratios.get(n),
                    ]
                    for n in med
                ],
            ),
            table(
                "Data-parallel scaling at the same global batch: 1 rank vs 2 ranks",
                [
                    "variant",
                    "ranks",
                    "step ms|.0f",
                    "tokens/s|,.0f",
                    "wall-clock efficiency|.0%",
                    "CPU-time efficiency|.0%",
                    "CPU ms per step per rank (all threads)|.0f",
                    "main thread ms per step: on CPU / waiting for a CPU / blocked|.0f",
                    "main thread waiting for a CPU, share of step|.0%",
                ],
                scale_rows,
            ),
            table(
                "Equal losses: every variant trains the same global batches from the same weights",
                [
                    "variant",
                    "step 1 loss|.5f",
                    "steps",
                    "last loss|.5f",
                    f"max abs(loss - {Z0}) over steps|.1e",
                ],
                [
                    [n, ls[0], len(ls), ls[-1], max(abs(a - b) for a, b in zip(ls, losses[Z0]))]
                    for n, ls in losses.items()
                ],
            ),
            *mem_tables,
            table(
                "Optimizer-side work of one step, tiny model, zero 0, one thread (thread CPU "
                "ms, median)",
                ["operation", "ms|.1f"],
                [[n, ms] for n, ms in optim.items()],
            ),
        ],
        "facts": {
            "optimizer side: torch's ms per step minus megatronish's|.1f": saved,
            "the same, share of a 2-rank zero 0 step's main-thread CPU|.1%": saved
            / (eff[Z0]["main_thread"]["on_cpu"] * 1e3),
            **{k: v for facts in mem_facts for k, v in facts.items()},
            "the training loop's own memory beside its tensors (runtime), MiB|.0f": mem["small"][
                "runtime"
            ]
            / MIB,
            "RSS right after the fork (Python + torch + the parent's pages), MiB|.0f": mem["small"][
                "variants"
            ]["zero 0"][0]["rss_start"]
            / MIB,
            "zero 3 step beside its shards (large model, planned): gathered params / full grads "
            "/ activations, MiB|.0f": [
                plan3[k] / MIB for k in ("params_step", "grads_step", "activations_peak")
            ],
            "weight-decay and grad-norm range lists, at most MiB per rank|.3f": masks / MIB,
            "ln(vocab)|.4f": math.log(cfg.model.vocab_size),
        },
    }


if __name__ == "__main__":
    cli(run, __doc__)
