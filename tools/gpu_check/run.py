"""Run the sections in order, each on its own: an exception fails that section only.

The time budget is a deadline for the whole run. Each section needs some seconds that no
timing share bounds (building models, warm-up steps, ``torch.compile``'s first compiles):
``FIXED_S`` estimates them on a GPU. A section starts only while that much is left (else it is
skipped, with the ``--sections`` rerun that would take it), and the timed repeats share what the
selected sections' fixed seconds leave of the budget, in proportion to their ``SHARE``, never
taking what a later section's fixed part needs (:meth:`CheckContext.share`).
"""

from __future__ import annotations

import signal
import time
import traceback
from collections.abc import Callable, Sequence

from gpu_check import (
    async_save,
    compiled,
    documents,
    flash,
    memory,
    moe_experts,
    recompute,
    resume,
    ring_kernels,
    syncs,
    throughput,
)
from gpu_check.context import CheckContext
from gpu_check.optional import first_line
from gpu_check.report import FAILED, SKIPPED, SectionResult

SECTIONS = (
    throughput,
    flash,
    memory,
    resume,
    recompute,
    syncs,
    moe_experts,
    async_save,
    documents,
    ring_kernels,
    compiled,  # last: its compiles take the most time, and it is skipped when none is left
)
# Seconds of a section's work on an H100 / H200 beyond its timed repeats (estimates, not yet
# measured on one: a GPU run's report gives each section's seconds), and what bounds them.
FIXED_S = {
    "throughput": 45,  # build the sized model and the reference, 3 warm-up steps each
    "flash": 20,  # a 2-layer model, the profiler's start-up, one forced-flash step
    "memory": 30,  # the sized model built alone, 3 steps
    "resume": 30,  # 2-layer trainers, 9 steps in deterministic mode, a save and a load
    "recompute": 60,  # the sized model per policy, warm-ups and a peak step each
    "syncs": 30,  # dense and MoE 2-layer models, 6 steps each under the sync checks
    "moe_experts": 20,  # 2-3 MoE layers, warm-ups, a peak step each
    "async_save": 45,  # about 0.9 GiB written three times, pinned buffers allocated once
    "documents": 180,  # FlexAttention and its block mask compiled (inductor) twice: the core's
    # shape, then the training step's
    "ring_kernels": 15,  # three blocks' forward and backward, the fp32 references
    "compiled": 300,  # the block compiled (inductor) three times: megatronish, fp8, reference
}


class Stopped(BaseException):
    """SIGTERM reached the run (a time limit's ``timeout``): stop after writing the report."""


def select(names: Sequence[str] | None) -> list:
    """The sections named (in the run's order), all for None; ValueError names unknown ones."""
    if not names:
        return list(SECTIONS)
    known = {m.NAME: m for m in SECTIONS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    return [m for m in SECTIONS if m.NAME in names]


def number(module, position: int) -> int:
    """A section's number in the report: its place in the full run (a rerun keeps it)."""
    return SECTIONS.index(module) + 1 if module in SECTIONS else position


def fixed_s(module, ctx: CheckContext) -> float:
    """``FIXED_S`` of ``module`` on a GPU; 0 in the smoke run (toy sizes, seconds in all)."""
    return 0.0 if ctx.smoke else float(FIXED_S.get(module.NAME, 0))


def run_section(module, ctx: CheckContext, position: int = 1) -> SectionResult:
    """Run one section (a module with ``NAME``, ``TITLE`` and ``run(ctx, out)``); skipped when
    less than its fixed seconds are left, failed (with the traceback on stderr) when it raises,
    failed and ``stopped`` when a SIGTERM (:class:`Stopped`) or Ctrl-C reached it."""
    out = SectionResult(module.NAME, module.TITLE, number=number(module, position))
    print(f"\n== {module.TITLE} ({ctx.elapsed():.0f} s of {ctx.budget_s:.0f} s used)", flush=True)
    t0 = time.monotonic()
    needs, left = fixed_s(module, ctx), ctx.remaining()
    if left <= 0 or left < needs:
        out.status = SKIPPED
        out.note(
            f"skipped: {max(left, 0):.0f} s of the budget left, it needs about {needs:.0f} s; "
            f"run it alone: --sections {module.NAME}"
        )
        return out
    try:
        module.run(ctx, out)
    except (Stopped, KeyboardInterrupt) as e:
        out.stopped = True
        out.fail(f"stopped after {time.monotonic() - t0:.0f} s ({type(e).__name__})")
    except Exception as e:  # noqa: BLE001 - any failure is this section's, reported
        traceback.print_exc()
        out.fail(first_line(e))
    finally:
        try:
            ctx.release()
        except Exception as e:  # noqa: BLE001 - a device error after a failure: reported
            if out.status != FAILED:
                out.fail(f"releasing its memory: {first_line(e)}")
        out.seconds = time.monotonic() - t0
    print(f"[{module.NAME}] {out.status} in {out.seconds:.1f} s", flush=True)
    return out


def run_all(
    ctx: CheckContext,
    sections=SECTIONS,
    after: Callable[[list[SectionResult]], None] | None = None,
) -> list[SectionResult]:
    """Run ``sections`` in order; ``after(results so far)`` once each has finished (the report
    is rewritten there). A stop (SIGTERM, Ctrl-C) ends the run after the section it hit."""
    sections = list(sections)
    ctx.plan([fixed_s(m, ctx) for m in sections], [getattr(m, "SHARE", 0.0) for m in sections])
    results: list[SectionResult] = []
    try:
        for i, module in enumerate(sections):
            ctx.reserved_s = sum(fixed_s(m, ctx) for m in sections[i + 1 :])
            results.append(run_section(module, ctx, i + 1))
            if after is not None:
                after(results)
            if results[-1].stopped:
                break
    except (Stopped, KeyboardInterrupt):  # between sections: what ran is reported
        pass
    return results


def stop_on_sigterm() -> Callable[[], None]:
    """Turn SIGTERM into :class:`Stopped` for the run; returns the undo."""

    def handler(signum, frame) -> None:
        raise Stopped()

    before = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, before)
