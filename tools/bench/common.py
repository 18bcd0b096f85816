"""What the benchmarks share: interleaved timing and medians, machine facts, the runs they
compare (megatronish's Trainer, the plain-PyTorch reference GPT) and their JSON output.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megatronish.config.compose import load_config
from megatronish.config.schema import TrainConfig
from megatronish.testing import reference_gpt
from megatronish.testing.runs import build_trainer
from megatronish.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MIB = 2**20


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads, restoring the previous count after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over repeats of ``numerator[i] / denominator[i]``: variants timed back to back saw
    the same load, so this is steadier than a ratio of medians."""
    return median([n / d for n, d in zip(numerator, denominator, strict=True)])


def ratio_interval(
    numerator: list[float], denominator: list[float], level: float = 0.9, resamples: int = 2000
) -> tuple[float, float]:
    """A bootstrap ``level`` interval of :func:`paired_ratio`: the repeats resampled with
    replacement (fixed seed), the median of each resample's per-repeat ratios, their quantiles.
    An interval that excludes 1 says the two variants differ beyond this run's noise."""
    ratios = [n / d for n, d in zip(numerator, denominator, strict=True)]
    rng = random.Random(0)
    medians = sorted(median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = int((1 - level) / 2 * resamples)
    return medians[tail], medians[resamples - 1 - tail]


def interleaved(
    steps: dict[str, Callable[[], object]],
    repeats: int,
    steps_per_repeat: int,
    warmup: int = 2,
    sync: Callable[[], None] | None = None,
    *,
    budget_s: float | None = None,
    min_repeats: int = 3,
    agree: Callable[[bool], bool] | None = None,
) -> dict[str, list[float]]:
    """Seconds per step of each variant, one entry per repeat.

    After ``warmup`` untimed steps of every variant, each repeat times ``steps_per_repeat``
    steps of every variant in turn, odd repeats in reverse order; ``sync`` runs before each
    timing. With ``budget_s`` no repeat starts after that many seconds once ``min_repeats``
    ran; in a world ``agree`` turns each rank's stop flag into one decision.
    """
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    for r in range(repeats):
        if budget_s is not None and r >= min_repeats:
            stop = time.perf_counter() - start > budget_s
            if agree(stop) if agree is not None else stop:
                break
        for name in names if r % 2 == 0 else reversed(names):
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            for _ in range(steps_per_repeat):
                steps[name]()
            times[name].append((time.perf_counter() - t0) / steps_per_repeat)
    return times


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def timed_world(steppers: dict[str, Callable[[], float]], repeats: int, steps: int, **kw) -> dict:
    """:func:`interleaved` on one rank of a world (a barrier before each timing, every rank
    stopping together), recording the losses: ``{"times", "losses"}``."""
    losses: dict[str, list[float]] = {n: [] for n in steppers}
    recorders = {n: (lambda n=n: losses[n].append(steppers[n]())) for n in steppers}
    times = interleaved(recorders, repeats, steps, sync=dist.barrier, agree=_any_rank, **kw)
    return {"times": times, "losses": losses}


def slowest(ranks: list[dict]) -> dict[str, list[float]]:
    """Per variant and repeat the slowest rank's seconds (a step takes as long as that)."""
    names = ranks[0]["times"]
    return {n: [max(ts) for ts in zip(*(r["times"][n] for r in ranks))] for n in names}


def machine_info() -> dict[str, object]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), cpu)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


# The CPU default model (configs/experiment/tiny.yaml) with the stdlib tokenizer's vocabulary,
# one microbatch of 8 per step, a constant learning rate (so the plain-PyTorch peers can follow
# the same run) and nothing but training in the step.
BENCH_OVERRIDES = [
    "+experiment=tiny",
    "model.vocab_size=4096",
    "trainer.micro_batch_size=8",
    "trainer.global_batch_size=8",
    "trainer.max_steps=1000000",
    "trainer.eval_interval=0",
    "trainer.device=cpu",
    "scheduler.style=constant",
    "scheduler.warmup_steps=0",
    "logging.wandb=false",
    "logging.log_interval=1000000",
]


@dataclass
class MishRun:
    """A ready-to-step megatronish Trainer and what built it."""

    cfg: TrainConfig
    spec: object
    chunks: list[nn.Module]
    trainer: Trainer
    data: object

    def step(self) -> float:
        return self.trainer.train_step().loss


def config(extra: list[str] | None = None):
    """The benchmark config with ``extra`` Hydra overrides on top."""
    return load_config([*BENCH_OVERRIDES, *(extra or [])])


def build_run(extra: list[str] | None = None, rank: int = 0, world: int = 1) -> MishRun:
    """A Trainer on the benchmark config; collective when ``world > 1``."""
    t = build_trainer(rank, world, list(extra or []), 1_000_000, model=BENCH_OVERRIDES)
    return MishRun(t.cfg, t.spec, t.chunks, t, t.train_data)


def batch(data, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[n, s]`` of samples ``first .. first + n`` (as the Trainer reads)."""
    rows = torch.stack([data[i] for i in range(first, first + n)])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def reference_model(spec, extra: list[str] | None = None, tp_groups: int = 1) -> nn.Module:
    """The plain-PyTorch reference GPT of ``spec``'s shape with megatronish's initial global
    weights (from the one-process model of the run built with ``extra``)."""
    model = reference_gpt.ReferenceGPT(reference_gpt.RefConfig.from_spec(spec, True, tp_groups))
    (chunk,) = build_run([*(extra or []), "parallel.tp=1", "parallel.sp=false"]).chunks
    weights = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    reference_gpt.load_megatronish_weights(model, weights)
    return model


@dataclass
class ReferenceRun:
    """``step()``: this rank's slice of the global batch (rank ``r`` of ``world`` takes samples
    ``[r B/world, (r + 1) B/world)``) -> forward -> backward -> clip -> AdamW, like the Trainer;
    returns the loss averaged over the world. ``micro_batch`` accumulates microbatches,
    ``context`` wraps forward and backward, ``clip`` replaces ``clip_grad_norm_``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: object
    global_batch: int
    grad_clip: float
    rank: int = 0
    world: int = 1
    micro_batch: int | None = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    clip: Callable[[list[nn.Parameter], float], object] = torch.nn.utils.clip_grad_norm_
    step_index: int = 0

    def step(self) -> float:
        per_rank = self.global_batch // self.world
        first = self.step_index * self.global_batch + self.rank * per_rank
        inputs, targets = batch(self.data, first, per_rank)
        self.optimizer.zero_grad(set_to_none=True)
        size, losses = self.micro_batch or per_rank, []
        with self.context():
            for x, y in zip(inputs.split(size), targets.split(size), strict=True):
                loss = self.model(x, y)
                (loss * (size / per_rank) if size < per_rank else loss).backward()
                losses.append(loss.detach())
        self.clip([p for p in self.model.parameters() if p.grad is not None], self.grad_clip)
        self.optimizer.step()
        self.step_index += 1
        mean = torch.stack(losses).mean() if len(losses) > 1 else losses[0].clone()
        if self.world > 1:
            dist.all_reduce(mean)
        return mean.item() / self.world


def reference_run(
    cfg: TrainConfig, spec, data, extra=None, wrap=None, tp_groups=1, **kw
) -> ReferenceRun:
    """A :class:`ReferenceRun` of :func:`reference_model` (passed through ``wrap``: DDP, FSDP2,
    DTensor) with the AdamW settings of the megatronish config ``cfg``."""
    model = reference_model(spec, extra, tp_groups)
    model = wrap(model) if wrap else model
    o = cfg.optimizer
    opt = reference_gpt.build_adamw(model, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps)
    return ReferenceRun(model, opt, data, cfg.trainer.global_batch_size, o.grad_clip, **kw)


def korthikanti(s: int, b: int, h: int, a: int, t: int, sp: bool) -> dict[str, float]:
    """Activation bytes per layer (Korthikanti et al.): as published (16-bit, 1-byte dropout
    masks, GeLU MLP of 4h), and in fp32 without dropout, with and without the s^2 term."""
    attn = a * s * s * b / t
    fp32 = s * b * h * ((64 / t) if sp else (16 + 48 / t))
    return {
        "16bit": s * b * h * ((34 / t) if sp else (10 + 24 / t)) + 5 * attn,
        "fp32": fp32 + 4 * attn,
        "fp32_no_attn": fp32,
    }


def table(caption: str, columns: list[str], rows: list[list[object]]) -> dict:
    """A table of raw cells; each column is ``"header|format spec"`` (see ``render.cell``)."""
    cols = [list(c.partition("|")[::2]) for c in columns]
    return {"caption": caption, "columns": cols, "rows": rows}


def cli(run: Callable[..., dict], doc: str, *options: tuple[str, dict]) -> None:
    """Command line of a benchmark ``[--quick]`` (plus ``options``): run it, store its JSON
    (``run`` returns title, config, results, tables and ``facts``: ``{"label|fmt": value}``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    for flag, kw in options:
        parser.add_argument(flag, **kw)
    args = vars(parser.parse_args())
    t0 = time.perf_counter()
    parts = run(**args)
    facts = [[*k.partition("|")[::2], v] for k, v in parts.pop("facts", {}).items()]
    out = {
        "name": Path(sys.argv[0]).stem,
        "title": parts.pop("title"),
        "quick": args["quick"],
        "machine": machine_info(),
        "seconds": time.perf_counter() - t0,
        **parts,
        "facts": [[label, value, fmt] for label, fmt, value in facts],
    }
    path = DOCS / "bench" / f"{out['name']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    from render import section_block

    print(section_block(out))
    print(f"wrote {path.relative_to(ROOT)}")
