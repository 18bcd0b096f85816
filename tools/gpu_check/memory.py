"""Section 3: the peak memory of a training step against the planner's prediction.

The throughput section's model is built alone on an emptied device and trained for a few steps;
``torch.cuda.max_memory_allocated`` (from before the build) is its peak. The states it holds are
read from its buffers (``megatronish.testing.memory.state_storage``) and set against the
planner's params, grads and optimizer bytes; the rest of the peak against the planned
activations. On a CPU there is no allocator peak to read: the step's activation peak comes from
``torch.profiler``'s allocation records instead (``megatronish.testing.memory.measure_step``).
"""

from __future__ import annotations

import torch

from gpu_check.context import CheckContext, GiB, gib
from gpu_check.report import SectionResult
from gpu_check.sizing import size_model
from megatronish.testing.memory import measure_step, state_storage

NAME = "memory"
TITLE = "Peak memory: measured and planned"
SHARE = 0.05
STEPS = 3
TOLERANCE = 0.15  # |measured / planned - 1| of the peak


def measure(ctx: CheckContext, overrides: list[str]) -> tuple[dict[str, int], int, str]:
    """(states held, peak bytes, how the peak was measured) of a freshly built trainer."""
    ctx.release()
    before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    built = ctx.build(overrides)
    if ctx.cuda:
        for _ in range(STEPS):
            ctx.step(built)
        peak = torch.cuda.max_memory_allocated(ctx.device) - before
        how = f"torch.cuda.max_memory_allocated over {STEPS} steps from an empty device"
        return state_storage(built.trainer), peak, how
    ctx.step(built)  # the optimizer's state exists after a first step
    m = measure_step(built.trainer)
    if m.activations is None:
        raise RuntimeError("torch.profiler recorded no allocation in the measured step")
    held = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer}
    how = "CPU: the states' storages plus the step's allocation peak from torch.profiler"
    return held, sum(held.values()) + m.activations, how


def run(ctx: CheckContext, out: SectionResult) -> None:
    size = size_model(ctx)
    plan = size.plan
    stage = plan.stages[0]
    out.note(size.describe())
    held, peak, how = measure(ctx, size.overrides)
    out.note(f"measured with {how}")
    planned = {
        "params": stage.states.params,
        "grads": stage.states.grads,
        "optimizer": stage.states.optimizer,
    }
    rows = [[k, gib(planned[k]), gib(held[k]), ratio(held[k], planned[k])] for k in planned]
    above, planned_above = peak - sum(held.values()), plan.peak_bytes - stage.states.total
    rows.append(
        [
            "activations and temporaries at the peak",
            gib(planned_above),
            gib(above),
            ratio(above, planned_above),
        ]
    )
    rows.append(["peak", gib(plan.peak_bytes), gib(peak), ratio(peak, plan.peak_bytes)])
    out.table("GiB per rank", ["", "planned", "measured", "measured / planned"], rows)
    out.note(
        f"the planner adds {size.runtime_bytes / GiB:.1f} GiB for the runtime (CUDA "
        "context, workspaces), which the allocator does not count"
    )
    off = peak / plan.peak_bytes - 1
    if abs(off) > TOLERANCE:
        out.fail(f"the measured peak is {off:+.0%} off the plan (tolerance {TOLERANCE:.0%})")


def ratio(measured: float, planned: float) -> str:
    return f"{measured / planned:.2f}" if planned else "n/a"
