"""Run the sections in order, each on its own: an exception fails that section only."""

from __future__ import annotations

import time
import traceback

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
from gpu_check.report import SKIPPED, SectionResult

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


def run_section(module, ctx: CheckContext) -> SectionResult:
    """Run one section (a module with ``NAME``, ``TITLE`` and ``run(ctx, out)``); skipped when
    the time budget is spent, failed (with the traceback on stderr) when it raises."""
    out = SectionResult(module.NAME, module.TITLE)
    print(f"\n== {module.TITLE} ({ctx.elapsed():.0f} s of {ctx.budget_s:.0f} s used)", flush=True)
    t0 = time.monotonic()
    if ctx.remaining() <= 0:
        out.status = SKIPPED
        out.note("skipped: the time budget is spent")
        return out
    try:
        module.run(ctx, out)
    except Exception as e:  # noqa: BLE001 - any failure is this section's, reported
        traceback.print_exc()
        first_line = str(e).splitlines()[0] if str(e) else ""
        out.fail(f"{type(e).__name__}: {first_line}")
    finally:
        ctx.release()
        out.seconds = time.monotonic() - t0
    print(f"[{module.NAME}] {out.status} in {out.seconds:.1f} s", flush=True)
    return out


def run_all(ctx: CheckContext, sections=SECTIONS) -> list[SectionResult]:
    return [run_section(module, ctx) for module in sections]
