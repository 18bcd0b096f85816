"""Section 5: the step time and peak memory of each recompute policy.

One trainer of the throughput section's model; before each of its steps the policy under test
is installed on its chunks (``megatronish.model.recompute.apply_recompute``, what
``trainer.recompute`` selects at build time), so the policies are timed interleaved on the same
weights. Then one step per policy measures its peak memory (CUDA), set against the planner's peak
for that policy.
"""

from __future__ import annotations

import torch
from bench.common import interleaved, median

from gpu_check.context import CheckContext, gib
from gpu_check.report import SectionResult
from gpu_check.sizing import size_model
from megatronish.model.flops import flops_per_token
from megatronish.model.recompute import apply_recompute
from megatronish.plan.estimate import make_plan

NAME = "recompute"
TITLE = "Recompute policies"
SHARE = 0.2
# (trainer.recompute, recompute_method, recompute_num_layers)
POLICIES = [("none", "uniform", 1), ("selective", "uniform", 1), ("full", "uniform", 1)]


def label(policy: tuple[str, str, int]) -> str:
    name, method, layers = policy
    return f"full ({method}, {layers} layer)" if name == "full" else name


def run(ctx: CheckContext, out: SectionResult) -> None:
    size = size_model(ctx)
    out.note(size.describe())
    built = ctx.build(size.overrides)
    chunks, rng = built.trainer.chunks, built.rng

    def with_policy(policy):
        def step() -> None:
            apply_recompute(chunks, *policy, rng=rng)
            ctx.step(built)

        return step

    steps = {label(p): with_policy(p) for p in POLICIES}
    budget = ctx.share(SHARE)
    out.note(
        f"timing up to {ctx.max_repeats} repeats of {ctx.steps_per_repeat} step(s) per "
        f"policy after {ctx.warmup} warm-up step(s), within {budget:.0f} s"
    )
    times = interleaved(
        steps,
        ctx.max_repeats,
        ctx.steps_per_repeat,
        warmup=ctx.warmup,
        sync=ctx.sync,
        budget_s=budget,
        min_repeats=2,
    )
    peaks = {}
    for p in POLICIES:
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        steps[label(p)]()
        peaks[label(p)] = torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None
    spec = built.spec
    tokens = built.cfg.trainer.global_batch_size * spec.seq_length
    flops = flops_per_token(spec) * tokens
    base = median(times[label(POLICIES[0])])
    rows = []
    for p in POLICIES:
        step = median(times[label(p)])
        layout = size.plan.layout.with_(
            recompute=p[0], recompute_method=p[1], recompute_num_layers=p[2]
        )
        planned = make_plan(size.plan.spec, layout).peak_bytes
        measured = peaks[label(p)]
        rows.append(
            [
                label(p),
                f"{step * 1e3:.1f}",
                f"{step / base:.2f}x",
                f"{tokens / step:,.0f}",
                ctx.mfu(flops, step),
                gib(planned),
                "n/a (CPU)" if measured is None else gib(measured),
            ]
        )
    out.table(
        f"{ctx.precision}, {tokens:,} tokens per step (MFU counts model FLOPs, not recompute)",
        [
            "policy",
            "ms per step",
            "vs none",
            "tokens/s",
            "MFU",
            "planned peak GiB",
            "measured peak GiB",
        ],
        rows,
    )
