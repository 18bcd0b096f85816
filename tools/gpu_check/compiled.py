"""Section 11: compiled blocks and fp8 linears against eager bf16 and the plain-PyTorch reference.

A four-layer model of the throughput section's shape (so that five models and their optimizer
states fit beside each other) trains the same batches from the same weights as: megatronish
eager, megatronish with ``trainer.compile`` (each block's forward compiled), the same with
``trainer.fp8=tensorwise``, and the reference eager and with each of its blocks compiled the same
way. Each variant's first step is timed alone (it compiles), then the steps are timed
interleaved. MFU counts against the bf16 peak, and the fp8 variant's also against the fp8 peak.
The smoke run (CPU, fp32) compiles with ``aot_eager`` (no code generation: within its budget)
and has no fp8 variant (fp8 needs bf16).
"""

from __future__ import annotations

import math
import time

from bench.common import interleaved, median, paired_ratio

from gpu_check.context import CheckContext, batch
from gpu_check.optional import optional
from gpu_check.reference import ReferenceRun
from gpu_check.report import SectionResult
from megatronish.model.flops import flops_per_token
from megatronish.training.peaks import device_peak_flops

NAME = "compiled"
TITLE = "Compiled blocks and fp8 linears"
SHARE = 0.15
LAYERS = 4
FP8 = "megatronish compiled fp8"  # the optional variant: left out where it cannot run
# Largest relative gap of a variant's last loss from eager megatronish's after the same steps.
LAST_LOSS_RTOL = 0.05


def run(ctx: CheckContext, out: SectionResult) -> None:
    backend = "aot_eager" if ctx.smoke else "inductor"
    shape = [f"model.num_layers={2 if ctx.smoke else LAYERS}", *batch(ctx.micro_batch_size)]
    compiled = ["trainer.compile=true", f"trainer.compile_backend={backend}"]
    runs = {"megatronish": ctx.build(shape), "megatronish compiled": ctx.build([*shape, *compiled])}
    fp8_peak = None
    if ctx.precision != "bf16":
        out.note(f"no fp8 variant: trainer.fp8 needs bf16, this run is {ctx.precision}")
    else:
        try:
            fp8_peak = device_peak_flops(ctx.device, "fp8", ctx.peak_tflops)
        except ValueError as e:  # a GPU without fp8 tensor cores
            out.note(f"no fp8 variant: {e}")
        else:
            fp8 = [*shape, *compiled, "trainer.fp8=tensorwise"]
            built = optional(out, FP8, lambda: ctx.build(fp8))
            if built is not None:
                runs[FP8] = built
    eager = runs["megatronish"].trainer
    refs = {
        "reference": ReferenceRun(eager, bf16=ctx.precision == "bf16"),
        "reference compiled": ReferenceRun(
            eager, bf16=ctx.precision == "bf16", compile_backend=backend
        ),
    }
    losses: dict[str, list[float]] = {}
    steppers = {}
    for name, built in runs.items():
        steppers[name] = _recorded(losses, name, lambda b=built: ctx.step(b).loss, ctx)
    for name, ref in refs.items():
        steppers[name] = _recorded(losses, name, ref.step, ctx)
    first = {}
    for name, step in list(steppers.items()):  # the first step compiles: timed alone
        t0 = time.perf_counter()
        if name == FP8:  # optional: a variant that cannot run here is left out
            if optional(out, name, lambda s=step: (s(), True)[1]) is None:
                del steppers[name], runs[name]
                continue
        else:
            step()
        first[name] = time.perf_counter() - t0
    out.note(f"backend {backend}; first step of each variant timed alone (it compiles)")
    times = interleaved(
        steppers,
        ctx.max_repeats,
        ctx.steps_per_repeat,
        warmup=max(ctx.warmup - 1, 0),
        sync=ctx.sync,
        budget_s=ctx.share(SHARE),
        min_repeats=2,
    )
    spec = runs["megatronish"].spec
    tokens = runs["megatronish"].cfg.trainer.global_batch_size * spec.seq_length
    flops = flops_per_token(spec) * tokens
    base = losses["megatronish"][-1]
    rows = []
    for name, ts in times.items():
        step = median(ts)
        mfu = ctx.mfu(flops, step)
        if name.endswith("fp8") and fp8_peak:
            mfu += f" ({flops / step / fp8_peak:.1%} of fp8 peak)"
        rows.append(
            [
                name,
                f"{first[name]:.1f}",
                f"{step * 1e3:.1f}",
                f"{tokens / step:,.0f}",
                mfu,
                f"{paired_ratio(times['megatronish'], ts):.2f}x",
                f"{losses[name][-1]:.4f}",
            ]
        )
        gap = abs(losses[name][-1] - base) / abs(base)
        if not math.isfinite(losses[name][-1]) or gap > LAST_LOSS_RTOL:
            out.fail(f"{name}: last loss {losses[name][-1]:.4f} vs eager {base:.4f} ({gap:.1%})")
    out.table(
        f"{ctx.precision}, {spec.num_layers} layers, {tokens:,} tokens per step, "
        f"{len(losses['megatronish'])} steps each",
        [
            "variant",
            "first step s",
            "ms per step",
            "tokens/s",
            "MFU",
            "speed vs megatronish eager",
            "last loss",
        ],
        rows,
    )
    out.note(f"peak for MFU: {ctx.peak[1]}")


def _recorded(losses: dict[str, list[float]], name: str, step, ctx: CheckContext):
    losses[name] = []

    def run_step() -> None:
        losses[name].append(step())
        ctx.sync()

    return run_step
