"""Section 1: megatronish and the plain-PyTorch reference train the same model side by side.

Both start from the same weights and see the same batches; their steps are timed interleaved
(``tools/bench/common.py``: A B, B A, ... after warm-up, medians), each step ending when the
device is done. MFU counts ``megatronish.model.flops.flops_per_token`` against the device table's
dense peak. The first losses must agree (same weights, same batch): otherwise the two would not
be doing the same work.
"""

from __future__ import annotations

from bench.common import interleaved, median, paired_ratio

from gpu_check.context import CheckContext
from gpu_check.reference import ReferenceRun
from gpu_check.report import SectionResult
from gpu_check.sizing import size_model
from megatronish.model.flops import flops_per_token

NAME = "throughput"
TITLE = "Throughput: megatronish and plain PyTorch"
SHARE = 0.25
# Largest relative gap of the first losses (bf16 rounds differently in the two models).
FIRST_LOSS_RTOL = {"bf16": 2e-2, "fp32": 1e-3}


def run(ctx: CheckContext, out: SectionResult) -> None:
    size = size_model(ctx)
    out.note(size.describe())
    mish = ctx.build(size.overrides)
    ref = ReferenceRun(mish.trainer, bf16=ctx.precision == "bf16")
    losses: dict[str, list[float]] = {"megatronish": [], "reference": []}

    def mish_step() -> None:
        losses["megatronish"].append(ctx.step(mish).loss)

    def ref_step() -> None:
        losses["reference"].append(ref.step())
        ctx.sync()

    budget = ctx.share(SHARE)
    out.note(
        f"timing up to {ctx.max_repeats} repeats of {ctx.steps_per_repeat} step(s) each "
        f"after {ctx.warmup} warm-up step(s), within {budget:.0f} s"
    )
    times = interleaved(
        {"megatronish": mish_step, "reference": ref_step},
        ctx.max_repeats,
        ctx.steps_per_repeat,
        warmup=ctx.warmup,
        sync=ctx.sync,
        budget_s=budget,
        min_repeats=2,
    )
    spec = mish.spec
    tokens = mish.cfg.trainer.global_batch_size * spec.seq_length
    flops = flops_per_token(spec) * tokens
    rows = []
    for name, ts in times.items():
        step = median(ts)
        first, last = losses[name][0], losses[name][-1]
        rows.append(
            [
                name,
                f"{step * 1e3:.1f}",
                f"{tokens / step:,.0f}",
                ctx.mfu(flops, step),
                f"{first:.4f}",
                f"{last:.4f}",
                len(ts),
            ]
        )
    out.table(
        f"{ctx.precision}, {tokens:,} tokens per step, {flops / tokens / 1e9:.2f} GFLOP per token",
        [
            "implementation",
            "ms per step",
            "tokens/s",
            "MFU",
            "first loss",
            "last loss",
            "timed repeats",
        ],
        rows,
    )
    ratio = paired_ratio(times["reference"], times["megatronish"])
    out.note(
        f"megatronish / reference throughput: {ratio:.2f}x (median of per-repeat ratios); "
        f"peak for MFU: {ctx.peak[1]}"
    )
    first_m, first_r = losses["megatronish"][0], losses["reference"][0]
    gap = abs(first_m - first_r) / abs(first_r)
    if not gap <= FIRST_LOSS_RTOL[ctx.precision]:
        out.fail(
            f"first losses differ by {gap:.2%} ({first_m:.5f} vs {first_r:.5f}): the two "
            "runs do not compute the same model"
        )
