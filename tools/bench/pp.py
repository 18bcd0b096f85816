"""Interleaved 1F1B on 2 ranks: megatronish (pp=2, vpp=2) vs torch.distributed.pipelining on
the reference GPT, and megatronish's measured bubble per rank. Next to them, with the same model and
microbatches, torch pipelining's zero-bubble schedules (``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``) and megatronish's rows for the same schedules
(``parallel.pipeline_schedule``), each pair at one layout; a row that cannot run is skipped with
its reason.
Run alone: ``.venv/bin/python tools/bench/pp.py [--quick]``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import build_run, cli, median, paired_ratio, ratio_interval, slowest, table
from torch import nn

from megatronish.config.schema import ParallelConfig, TrainConfig
from megatronish.pipeline.engine import Timeline
from megatronish.pipeline.simulate import analytic_bubble
from megatronish.pipeline.trace import measured_bubble, phase_time, step_span
from megatronish.testing.multiproc import WorldError, run_world
from megatronish.testing.reference_gpt import build_adamw

PP, VPP, LAYERS, MICROBATCHES, MICRO_BATCH = 2, 2, 8, 8, 1
MODEL = [
    f"model.num_layers={LAYERS}",
    f"trainer.micro_batch_size={MICRO_BATCH}",
    f"trainer.global_batch_size={MICROBATCHES * MICRO_BATCH}",
]
LAYOUT = [f"parallel.pp={PP}", f"parallel.vpp={VPP}"]
VARIANTS = ("megatronish", "torch pipelining")  # the interleaved 1F1B pair (first table)


@dataclass(frozen=True)
class Schedule:
    """A pair of rows: megatronish's ``parallel.pipeline_schedule=name`` (``megatronish=False``:
    a torch row alone) and torch pipelining's ``torch_class``, both with ``vpp`` chunks per rank
    (zbv: the V, otherwise chunk c on rank c mod pp)."""

    name: str
    vpp: int
    torch_class: str
    megatronish: bool = True


SCHEDULES = (
    Schedule("interleaved", VPP, "ScheduleInterleaved1F1B"),
    Schedule("zb-h1", 1, "ScheduleInterleavedZeroBubble"),  # megatronish's zb-h1 has vpp = 1
    Schedule("interleaved zb", VPP, "ScheduleInterleavedZeroBubble", megatronish=False),
    Schedule("zbv", 2, "ScheduleZBVZeroBubble"),
)
INTERLEAVED = SCHEDULES[0]
# Layers per chunk: the even split both variants are timed with, and one that balances the
# ranks (the last chunk's head + loss over the vocabulary costs about two layers here).
EVEN, BALANCED = [LAYERS // (PP * VPP)] * (PP * VPP), [3, 2, 2, 1]
SPLIT_OVERRIDE = f"parallel.pipeline_layer_split=[{','.join(map(str, BALANCED))}]"


def variant(framework: str, schedule: Schedule) -> str:
    """A row's name: the interleaved pair keeps the names of :data:`VARIANTS`."""
    return framework if schedule == INTERLEAVED else f"{framework} {schedule.name}"


def rank_chunks(schedule: Schedule, rank: int) -> list[int]:
    """The global chunks on pipeline rank ``rank``, in local order: chunk c on rank c mod pp,
    or with zbv the V (vpp = 2: chunk c < pp on rank c, chunk c >= pp on rank 2 pp - 1 - c)."""
    if schedule.name == "zbv":
        return [rank, 2 * PP - 1 - rank]
    return list(range(rank, PP * schedule.vpp, PP))


def mish_layout(schedule: Schedule) -> list[str]:
    """megatronish's layout overrides for ``schedule``; the interleaved pair runs without the
    schedule key where the config has none yet. Raises ValueError if it cannot name it."""
    layout = [f"parallel.pp={PP}", f"parallel.vpp={schedule.vpp}"]
    if "pipeline_schedule" in {f.name for f in dataclasses.fields(ParallelConfig)}:
        return [*layout, f"parallel.pipeline_schedule={schedule.name}"]
    if schedule == INTERLEAVED:
        return layout
    raise ValueError("the config has no parallel.pipeline_schedule yet")


class StageModule(nn.Module):
    """Consecutive layers of the reference GPT, with its embedding and/or norm + head."""

    def __init__(self, ref: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.embed = ref.tok_embeddings if first else None
        self.layers = nn.ModuleList(ref.layers[i] for i in layers)
        self.norm, self.output = (ref.norm, ref.output) if last else (None, None)
        self.register_buffer("cos", ref.cos.clone(), persistent=False)
        self.register_buffer("sin", ref.sin.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return x if self.output is None else self.output(self.norm(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference GPT's loss, as the schedule's ``loss_fn`` (mean over the microbatch)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TorchPipelineRun:
    """One optimizer step of the reference GPT under ``schedule``'s torch pipelining class on
    this rank."""

    def __init__(self, rank: int, cfg: TrainConfig, spec, data, schedule: Schedule = INTERLEAVED):
        from torch.distributed import pipelining

        ref = common.reference_model(spec, MODEL)
        n = PP * schedule.vpp
        per_chunk = LAYERS // n
        s, b, h, z = spec.seq_length, MICRO_BATCH, spec.hidden_size, torch.zeros
        stages, self.modules = [], []
        chunks = rank_chunks(schedule, rank)
        for c in chunks:
            module = StageModule(ref, range(c * per_chunk, (c + 1) * per_chunk), c == 0, c == n - 1)
            # Static shapes (no handshake, like megatronish); a received activation needs grad.
            x = z(b, s, dtype=torch.long) if c == 0 else z(b, s, h).requires_grad_()
            y = z(b, s, spec.padded_vocab_size if c == n - 1 else h).requires_grad_()
            stages.append(
                pipelining.PipelineStage(
                    module, c, n, torch.device("cpu"), input_args=x, output_args=y
                )
            )
            self.modules.append(module)
        kind = getattr(pipelining, schedule.torch_class)
        self.schedule = kind(stages, MICROBATCHES, loss_fn=cross_entropy)
        params = nn.ModuleList(self.modules)
        o = cfg.optimizer
        self.params = list(params.parameters())
        self.optimizer = build_adamw(params, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps)
        self.grad_clip, self.data, self.step_index = o.grad_clip, data, 0
        self.holds_loss = n - 1 in chunks

    def step(self) -> float:
        """Forward/backward every microbatch, clip the global grad norm, AdamW; the mean loss."""
        n = MICROBATCHES * MICRO_BATCH
        inputs, targets = common.batch(self.data, self.step_index * n, n)
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        self.schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm_sq = torch.stack([g.pow(2).sum() for g in grads]).sum()
        dist.all_reduce(norm_sq)  # the global norm over both pipeline ranks
        norm = norm_sq.sqrt().item()
        if norm > self.grad_clip:
            torch._foreach_mul_(grads, self.grad_clip / (norm + 1e-6))
        self.optimizer.step()
        self.step_index += 1
        return torch.stack(losses).mean().item() if self.holds_loss else float("nan")


def _recorded_steps(run, steps: int) -> list[list]:
    """megatronish steps recorded with a Timeline, events in absolute perf_counter seconds."""
    out = []
    for _ in range(steps):
        dist.barrier()
        run.trainer.timeline = timeline = Timeline()
        run.step()
        run.trainer.timeline = None
        out.append([(n, s + timeline.origin, e + timeline.origin) for n, s, e in timeline.events])
    return out


def _row_step(framework: str, schedule: Schedule, rank: int, world: int, base=None):
    """The step of one row on this rank; torch's rows take the model shape, data and config
    from ``base`` (the interleaved megatronish run; built here when not given)."""
    if framework == VARIANTS[0]:
        return build_run([*MODEL, *mish_layout(schedule)], rank, world).step
    base = base or build_run([*MODEL, *LAYOUT], rank, world)
    return TorchPipelineRun(rank, base.cfg, base.spec, base.data, schedule).step


def _probe(rank: int, world: int, framework: str, schedule: Schedule) -> float:
    """Build one row and run a step of it, in a world of its own (a broken schedule can hang)."""
    loss = _row_step(framework, schedule, rank, world)()
    dist.barrier()
    return loss


def _reason(e: Exception) -> str:
    """The error line of a rank's traceback (``KeyError: ...``), else the message's first line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception|Exit)\b:?", line)]
    return (errors or lines or [type(e).__name__])[-1 if errors else 0]


def runnable_rows() -> tuple[list[tuple[str, Schedule]], dict[str, str]]:
    """The (framework, schedule) rows beside the interleaved pair that build and take a step,
    and why each other one is skipped (also printed)."""
    rows, skipped = [], {}
    for schedule in SCHEDULES[1:]:
        for framework in VARIANTS if schedule.megatronish else VARIANTS[1:]:
            name = variant(framework, schedule)
            try:
                if framework == VARIANTS[0]:
                    mish_layout(schedule)
                run_world(_probe, PP, framework, schedule, timeout=300, collective_timeout=60)
            except (ValueError, WorldError) as e:
                skipped[name] = _reason(e)
                print(f"skipped {name}: {skipped[name]}", flush=True)
                continue
            rows.append((framework, schedule))
    return rows, skipped


def _rank(
    rank: int,
    world: int,
    repeats: int,
    steps: int,
    recorded: int,
    rows: list[tuple[str, Schedule]],
) -> dict:
    mish = build_run([*MODEL, *LAYOUT], rank, world)
    balanced = build_run([*MODEL, *LAYOUT, SPLIT_OVERRIDE], rank, world)
    peer = TorchPipelineRun(rank, mish.cfg, mish.spec, mish.data)
    steppers = {VARIANTS[0]: mish.step, VARIANTS[1]: peer.step}
    for framework, schedule in rows:
        steppers[variant(framework, schedule)] = _row_step(framework, schedule, rank, world, mish)
    out = common.timed_world(steppers, repeats, steps)
    balanced.step()  # warm-up
    out["timelines"] = {
        str(EVEN): _recorded_steps(mish, recorded),
        str(BALANCED): _recorded_steps(balanced, recorded),
    }
    dist.barrier()  # ranks leave together (a rank exiting early can hang gloo shutdown)
    return out


def bubble(ranks: list[dict], split: str) -> dict:
    """Step spans and per-rank fwd / bwd / comm seconds and measured bubble of one split."""
    steps = [dict(enumerate(t)) for t in zip(*(r["timelines"][split] for r in ranks))]
    spans = [step_span(t)[1] - step_span(t)[0] for t in steps]
    per_rank = {
        r: {
            "fwd_s": [phase_time(t[r], "fwd") for t in steps],
            "bwd_s": [phase_time(t[r], "bwd") for t in steps],
            "comm_s": [phase_time(t[r], "comm") for t in steps],
            "bubble": [measured_bubble(t[r], step_span(t)) for t in steps],
        }
        for r in range(PP)
    }
    return {
        "step_span_s": spans,
        "per_rank": per_rank,
        "analytic": analytic_bubble(PP, VPP, MICROBATCHES),
    }


def _losses(ranks: list[dict]) -> dict[str, list[float]]:
    """Each row's losses from the rank holding its last chunk (nan on the others)."""
    out = {}
    for name in ranks[0]["losses"]:
        held = [r["losses"][name] for r in ranks if not math.isnan(r["losses"][name][0])]
        out[name] = held[0] if held else ranks[-1]["losses"][name]
    return out


def schedule_rows(times: dict[str, list[float]], skipped: dict[str, str]) -> dict[str, dict]:
    """Per schedule: its torch pipelining class and vpp, each framework's median step (None
    where skipped; ``skipped`` says why) and megatronish's step over torch's (ratio of medians
    and median of per-repeat ratios; None unless both ran)."""
    out = {}
    for schedule in SCHEDULES:
        mish, peer = (variant(f, schedule) for f in VARIANTS)
        names = (mish, peer) if schedule.megatronish else (peer,)
        both = mish in times and peer in times
        out[schedule.name] = {
            "torch_schedule": schedule.torch_class,
            "vpp": schedule.vpp,
            "median_step_s": {n: median(times[n]) if n in times else None for n in names},
            "skipped": {n: skipped[n] for n in names if n in skipped},
            "ratio": median(times[mish]) / median(times[peer]) if both else None,
            "paired_ratio": paired_ratio(times[mish], times[peer]) if both else None,
            "paired_ratio_interval": ratio_interval(times[mish], times[peer]) if both else None,
        }
    return out


def _schedule_table_rows(schedules: dict[str, dict], tokens: int) -> list[list[object]]:
    interleaved = schedules[INTERLEAVED.name]["median_step_s"][VARIANTS[1]]
    rows = []
    for schedule in SCHEDULES:
        row = schedules[schedule.name]
        peer = row["median_step_s"][variant(VARIANTS[1], schedule)]
        for name, s in row["median_step_s"].items():
            ran = s is not None
            rows.append(
                [
                    schedule.name,
                    schedule.vpp,
                    row["torch_schedule"],
                    name,
                    s * 1e3 if ran else None,
                    tokens / s if ran else None,
                    s / peer if ran and peer else None,
                    row["paired_ratio"] if name == variant(VARIANTS[0], schedule) else None,
                    _interval(row["paired_ratio_interval"])
                    if name == variant(VARIANTS[0], schedule)
                    else None,
                    s / interleaved if ran else None,
                    row["skipped"].get(name),
                ]
            )
    return rows


def _interval(bounds: tuple[float, float] | None) -> str | None:
    return None if bounds is None else f"{bounds[0]:.3f}x - {bounds[1]:.3f}x"


def run(quick: bool = False) -> dict:
    repeats, steps, recorded = (3, 1, 2) if quick else (21, 1, 3)
    rows, skipped = runnable_rows()
    ranks = run_world(
        _rank, PP, repeats, steps, recorded, rows, timeout=1800, collective_timeout=300
    )
    m = common.config([*MODEL, *LAYOUT]).model
    times = slowest(ranks)
    med = {n: median(ts) for n, ts in times.items()}
    tokens = MICROBATCHES * MICRO_BATCH * m.seq_length
    paired = paired_ratio(times[VARIANTS[0]], times[VARIANTS[1]])
    interval = ratio_interval(times[VARIANTS[0]], times[VARIANTS[1]])
    losses = _losses(ranks)
    bubbles = {split: bubble(ranks, split) for split in (str(EVEN), str(BALANCED))}
    schedules = schedule_rows(times, skipped)
    return {
        "title": "Pipeline parallelism, 2 ranks, interleaved 1F1B: megatronish vs torch pipelining",
        "config": {
            "repeats": repeats,
            "steps_per_repeat": steps,
            "recorded_steps": recorded,
            "warmup": 2,
            "pp": PP,
            "vpp": VPP,
            "layers": LAYERS,
            "microbatches": MICROBATCHES,
            "micro_batch": MICRO_BATCH,
            "balanced_split": SPLIT_OVERRIDE,
            "schedules": [dataclasses.asdict(s) for s in SCHEDULES],
            "chunks_per_rank": {s.name: [rank_chunks(s, r) for r in range(PP)] for s in SCHEDULES},
        },
        "results": {
            "step_times_s": times,
            "median_step_s": med,
            "paired_ratio": paired,
            "paired_ratio_interval": interval,
            "ratio": med[VARIANTS[0]] / med[VARIANTS[1]],
            "losses": losses,
            "schedules": schedules,
            "skipped": skipped,
            "bubble": bubbles,
            "tokens_per_step": tokens,
            "per_rank_times": [r["times"] for r in ranks],
        },
        "tables": [
            table(
                "Step time (median over repeats)",
                [
                    "variant",
                    "step ms|.0f",
                    "tokens/s|,.0f",
                    "step time / torch pipelining's|.2fx",
                    "same, median of per-repeat ratios|.2fx",
                    "90% bootstrap interval of that median",
                ],
                [
                    [n, med[n] * 1e3, tokens / med[n], med[n] / med[VARIANTS[1]], p, i]
                    for n, p, i in zip(VARIANTS, (paired, None), (_interval(interval), None))
                ],
            ),
            table(
                "Schedules side by side (same shape and microbatches, fused AdamW; every row "
                "timed in turn in the same world, median over repeats)",
                [
                    "schedule",
                    "vpp",
                    "torch pipelining class",
                    "variant",
                    "step ms|.0f",
                    "tokens/s|,.0f",
                    "step time / torch pipelining's, same schedule|.2fx",
                    "same, median of per-repeat ratios|.2fx",
                    "90% bootstrap interval of that median",
                    "step time / torch interleaved 1F1B's|.2fx",
                    "skipped because",
                ],
                _schedule_table_rows(schedules, tokens),
            ),
            table(
                "Sanity: losses (last stage) of the same run",
                ["variant", "first loss|.5f", "steps", "last loss|.5f"],
                [[n, ls[0], len(ls), ls[-1]] for n, ls in losses.items()],
            ),
            table(
                "Bubble per pipeline rank, megatronish (one step's forward/backward phase)",
                [
                    "layers per chunk",
                    "step fwd/bwd ms|.0f",
                    "pp rank",
                    "fwd ms|.0f",
                    "bwd ms|.0f",
                    "send/recv ms|.0f",
                    "measured bubble|.1%",
                    f"analytic (pp-1)/(vpp*m), m={MICROBATCHES}|.1%",
                ],
                [
                    [
                        split,
                        median(b["step_span_s"]) * 1e3,
                        r,
                        median(d["fwd_s"]) * 1e3,
                        median(d["bwd_s"]) * 1e3,
                        median(d["comm_s"]) * 1e3,
                        median(d["bubble"]),
                        b["analytic"],
                    ]
                    for split, b in bubbles.items()
                    for r, d in b["per_rank"].items()
                ],
            ),
        ],
        "facts": {"ln(vocab)|.4f": math.log(m.vocab_size)},
    }


if __name__ == "__main__":
    cli(run, __doc__)
