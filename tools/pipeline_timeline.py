"""Record one pipeline-parallel training step on CPU (or simulate one) and draw its timeline.

Runs a short pp job on forked gloo ranks (one thread each), records every op of the last step
on every pipeline rank, and writes OUT.json (a Chrome trace: open it in https://ui.perfetto.dev
or chrome://tracing) and OUT.png (a Gantt chart: warm-up, steady state, cool-down and the
bubbles). Prints each rank's forward, backward and send/recv time and its measured bubble next
to the schedule's analytic one ((pp-1)/(vpp*m) for 1F1B). ``--schedule`` picks the pipeline
schedule (``parallel.pipeline_schedule``: 1f1b, interleaved, zb-h1 or zbv; default: 1f1b for
vpp=1, interleaved above); the zero-bubble ones draw each backward as B (input grad) and W
(weight grads). ``--simulate`` draws the schedule's event simulation instead of running it (no
processes; F, B and W take the model's relative FLOPs, one unit per ms).

The model is the tiny llama with 8 layers (hidden 128, vocab 4096, seq 256, micro batch 1, as in
tools/bench/pp.py) unless Hydra overrides say otherwise; tp/dp overrides add ranks
(world = tp * pp * dp).

OUT defaults to outputs/pipeline/pipeline; ``--out docs/pipeline`` regenerates the figure the
docs show (docs/pipeline.png and its trace).

Example:
    python tools/pipeline_timeline.py --pp 2 --vpp 2 --microbatches 8
    python tools/pipeline_timeline.py --pp 2 --vpp 1 model.hidden_size=256 parallel.tp=2
    python tools/pipeline_timeline.py --pp 4 --vpp 1 --schedule zb-h1 --simulate
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from megatronish.config.pipeline_rules import PIPELINE_SCHEDULES, resolve_pipeline_schedule

# The model every rank builds; the command's overrides come after these and win.
MODEL = [
    "+experiment=tiny",
    "model.num_layers=8",
    "model.vocab_size=4096",
    "trainer.micro_batch_size=1",
    "trainer.eval_interval=0",
    "trainer.device=cpu",
    "scheduler.style=constant",
    "scheduler.warmup_steps=0",
    "logging.wandb=false",
    "logging.log_interval=1000000",
]

# Where a run's files go unless --out says: under outputs/ (ignored by git), never over the
# committed docs/pipeline.{json,png}.
DEFAULT_OUT = "outputs/pipeline/pipeline"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (2)")
    p.add_argument("--vpp", type=int, default=2, help="virtual chunks per stage (2)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (8)")
    p.add_argument(
        "--schedule",
        choices=PIPELINE_SCHEDULES,
        default=None,
        help="pipeline schedule (default: 1f1b for vpp=1, interleaved above)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="draw the schedule's simulation (no processes) instead of a recorded step",
    )
    p.add_argument("--steps", type=int, default=3, help="steps to run; the last is recorded (3)")
    p.add_argument(
        "--out", default=DEFAULT_OUT, help=f"writes OUT.json and OUT.png ({DEFAULT_OUT})"
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds before the run is killed")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.hidden_size=256")
    return p.parse_args(argv)


def job_overrides(args: argparse.Namespace) -> tuple[list[str], int]:
    """The layout and batch overrides of the run, and its world size."""
    from megatronish.config.compose import load_config

    layout = [f"parallel.pp={args.pp}", f"parallel.vpp={args.vpp}"]
    if args.schedule is not None:
        layout.append(f"parallel.pipeline_schedule={args.schedule}")
    layout += args.overrides
    cfg = load_config([*MODEL, *layout])
    p = cfg.parallel
    dp = p.dp or 1
    world = p.tp * p.pp * dp
    batch = args.microbatches * cfg.trainer.micro_batch_size * dp
    return [f"trainer.global_batch_size={batch}", *layout], world


def _rank(rank: int, world: int, overrides: list[str], steps: int) -> tuple[int, list] | None:
    """Train ``steps`` steps, recording the last; pipeline rank and absolute-time events."""
    import torch.distributed as dist

    from megatronish.pipeline.engine import Timeline
    from megatronish.testing.runs import build_trainer

    trainer = build_trainer(rank, world, overrides, steps, model=MODEL)
    for _ in range(steps - 1):
        trainer.train_step()
    dist.barrier()
    trainer.timeline = timeline = Timeline()
    trainer.train_step()
    trainer.timeline = None
    dist.barrier()  # ranks leave together
    c = trainer.topo.coords
    if c.tp != 0 or c.dp != 0:
        return None
    return c.pp, [(n, s + timeline.origin, e + timeline.origin) for n, s, e in timeline.events]


ANALYTIC = {
    "1f1b": "(pp-1)/(vpp*m)",
    "interleaved": "(pp-1)/(vpp*m)",
    "zb-h1": "(pp-1)(f+b-w)/(m(f+b+w))",
    "zbv": "(pp-1)(f+b-w)/(2m(f+b+w)), exact for f=b=w",
}
TITLES = {"1f1b": "1F1B", "interleaved": "Interleaved 1F1B", "zb-h1": "ZB-H1", "zbv": "ZBV"}


def op_times(overrides: list[str]) -> tuple[float, float, float]:
    """A chunk's relative forward, B and W times: the model's FLOPs per token
    (:func:`~megatronish.model.flops.split_backward_times`) in units of the forward."""
    from megatronish.config.compose import load_config
    from megatronish.model.flops import split_backward_times
    from megatronish.plan.layout import spec_of

    f, b, w = split_backward_times(spec_of(load_config([*MODEL, *overrides])))
    return 1.0, b / f, w / f


def summary(
    timelines: dict,
    pp: int,
    vpp: int,
    m: int,
    schedule: str | None = None,
    times: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> list[str]:
    """Lines comparing each rank's measured bubble with the schedule's formula (``times``: a
    chunk's relative F, B and W, which the zero-bubble ones depend on)."""
    from megatronish.pipeline.simulate import analytic_bubble
    from megatronish.pipeline.trace import (
        BACKWARD,
        busy_time,
        measured_bubble,
        phase_time,
        step_span,
    )

    schedule = resolve_pipeline_schedule(schedule, vpp)
    f, b, w = times
    analytic = analytic_bubble(pp, vpp, m, schedule, f, b + w, w)
    span = step_span(timelines)
    lines = [
        f"step {(span[1] - span[0]) * 1e3:.0f} ms (forward/backward only); analytic bubble "
        f"{ANALYTIC[schedule]} = {analytic:.1%}",
        f"{'rank':>4}  {'fwd ms':>7}  {'bwd ms':>7}  {'of it W':>7}  {'send/recv ms':>12}  "
        f"{'bubble':>7}",
    ]
    for r in sorted(timelines):
        ev = timelines[r]
        lines.append(
            f"{r:>4}  {phase_time(ev, 'fwd') * 1e3:7.0f}  {phase_time(ev, *BACKWARD) * 1e3:7.0f}  "
            f"{phase_time(ev, 'bwd_weight') * 1e3:7.0f}  {phase_time(ev, 'comm') * 1e3:12.0f}  "
            f"{measured_bubble(ev, span):7.1%}"
        )
    lines.append(
        "bubble: (step span - the rank's fwd+bwd time) / that time; waiting in a receive counts "
        f"as bubble. Busy {', '.join(f'{busy_time(timelines[r]) * 1e3:.0f}' for r in timelines)}"
        " ms: unequal ranks (the last chunk also runs the head and loss) wait for the slowest; "
        "parallel.pipeline_layer_split=[...] moves layers between chunks."
    )
    return lines


def simulated(args: argparse.Namespace, times: tuple[float, float, float]) -> dict:
    """The schedule's simulated step as timelines (one time unit per ms)."""
    from megatronish.pipeline.simulate import simulate
    from megatronish.pipeline.trace import simulated_timelines

    f, b, w = times
    sim = simulate(
        args.pp, args.vpp, args.microbatches, f, b + w, schedule=args.schedule, weight_time=w
    )
    return simulated_timelines(sim)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps={args.steps} must be at least 1 (the last step is recorded).")
    os.environ.setdefault("WANDB_MODE", "disabled")
    from megatronish.pipeline.schedule import check_schedule
    from megatronish.pipeline.trace import gantt_png, write_chrome_trace
    from megatronish.testing.multiproc import run_world

    try:
        schedule = check_schedule(args.pp, args.vpp, args.microbatches, schedule=args.schedule)
    except ValueError as e:
        shape = f"--pp {args.pp} --vpp {args.vpp} --microbatches {args.microbatches}"
        raise SystemExit(f"{shape}: {e}") from None
    overrides, world = job_overrides(args)
    times = op_times(overrides)
    t0 = time.perf_counter()
    if args.simulate:
        print(f"simulating {schedule} with pp={args.pp} vpp={args.vpp} m={args.microbatches}")
        timelines = simulated(args, times)
        how = f"simulated, F:B:W = {times[0]:.2f}:{times[1]:.2f}:{times[2]:.2f}"
    else:
        print(
            f"running pp={args.pp} vpp={args.vpp} m={args.microbatches} on {world} ranks: "
            f"{' '.join(overrides)}",
            flush=True,
        )
        results = run_world(_rank, world, overrides, args.steps, timeout=args.timeout)
        timelines = dict(r for r in results if r is not None)
        how = "one CPU thread per rank, gloo"
    out = args.out
    trace = write_chrome_trace(Path(f"{out}.json"), timelines)
    title = (
        f"{TITLES[schedule]}, pp={args.pp} vpp={args.vpp}, {args.microbatches} microbatches ({how})"
    )
    png = gantt_png(Path(f"{out}.png"), timelines, title)
    print("\n".join(summary(timelines, args.pp, args.vpp, args.microbatches, schedule, times)))
    print(f"wrote {trace} and {png} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
