"""Which pipeline schedule a layout runs (``parallel.pipeline_schedule``) and what each needs.

``1f1b`` (vpp = 1) and ``interleaved`` (vpp > 1) are the defaults; ``zb-h1`` (vpp = 1) and
``zbv`` (vpp = 2, the chunks in a V) split each backward into B and W to fill the bubble
(:mod:`megatronish.pipeline.zero_bubble`). The rules live here so the config check and the
schedules refuse the same layouts with the same words.
"""

from __future__ import annotations

PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")
SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "zbv")  # B and W as separate ops
V_SHAPE_SCHEDULES = ("zbv",)  # chunk c < pp on stage c, chunk c >= pp on stage 2 pp - 1 - c


def resolve_pipeline_schedule(schedule: str | None, vpp: int) -> str:
    """``schedule``, or when None the default: ``1f1b`` for vpp = 1, ``interleaved`` above."""
    if schedule is None:
        return "1f1b" if vpp == 1 else "interleaved"
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"parallel.pipeline_schedule={schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    return schedule


def pipeline_schedule_error(schedule: str, pp: int, vpp: int, num_microbatches: int) -> str | None:
    """Why ``schedule`` cannot run pp / vpp / m (one line naming the fix), or None."""
    m = num_microbatches
    if schedule in ("1f1b", "zb-h1") and vpp != 1:
        return (
            f"pipeline_schedule={schedule} runs one chunk per stage, not vpp={vpp}; set "
            "parallel.vpp=1, or use interleaved (or zbv with vpp=2)"
        )
    if schedule == "interleaved" and vpp == 1:
        return "pipeline_schedule=interleaved needs parallel.vpp > 1; with vpp=1 use 1f1b or zb-h1"
    if schedule == "zbv" and vpp != 2:
        return (
            f"pipeline_schedule=zbv runs two chunks per stage in a V: set parallel.vpp=2, not {vpp}"
        )
    if schedule == "interleaved" and m % pp != 0:
        return (
            f"interleaved pipelining needs microbatches per step ({m}) divisible by "
            f"parallel.pp={pp}; change trainer.global_batch_size"
        )
    return None
