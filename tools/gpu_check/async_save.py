"""Section 8: how long a checkpoint save holds the training thread, blocking and asynchronous.

A one-layer model of the shape with an 8k vocabulary (about 0.9 GiB of checkpointed state: fp32
main params and two Adam moments) trains, then ``CheckpointSaver.save`` runs three times, a step
apart: a first blocking save (it also allocates the pinned host buffers that later saves reuse),
a blocking save, and an asynchronous one (``save(blocking=False)``: the snapshot queues its
device->host copies on a side stream and returns, a thread writes the files). For each, the
seconds ``save()`` held the training thread (the device idle before it); for the asynchronous
one also the seconds until its files were written and published (``wait()``) and the training
step that ran meanwhile, against one without a save. On CUDA the section fails when the
asynchronous save holds the thread for more than ``STALL_LIMIT`` of the blocking one's time. On
the CPU copies are immediate (toy size): the numbers only show the path runs.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from gpu_check.context import CheckContext, batch, gib
from gpu_check.report import SectionResult
from megatronish.checkpoint.save import CheckpointSaver

NAME = "async_save"
TITLE = "Checkpoint save stall: blocking and asynchronous"
SHARE = 0.05
STALL_LIMIT = 0.5  # asynchronous save() time / blocking save() time
FULL = ["model.num_layers=1", "model.vocab_size=8000", *batch(1)]


def timed(ctx: CheckContext, fn) -> tuple[object, float]:
    """``fn()``'s result and seconds, the device idle before it."""
    ctx.sync()
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def state_bytes(step_dir: Path) -> int:
    """Bytes of the checkpoint's tensor files."""
    return sum(f.stat().st_size for f in step_dir.glob("*.safetensors"))


def run(ctx: CheckContext, out: SectionResult) -> None:
    with tempfile.TemporaryDirectory(prefix="gpu_check_save_") as tmp:
        # async_save: the run's saves (blocking ones too) copy into pinned buffers on a side stream
        overrides = [
            *(ctx.small() if ctx.smoke else FULL),
            f"checkpoint.dir={tmp}",
            "checkpoint.async_save=true",
        ]
        built = ctx.build(overrides)
        saver = CheckpointSaver(built.cfg, built.trainer.checkpoint_parts)
        for _ in range(ctx.warmup):
            ctx.step(built)
        first, first_s = timed(ctx, lambda: saver.save(blocking=True))
        size = state_bytes(Path(first))
        ctx.step(built)
        _, blocking_s = timed(ctx, lambda: saver.save(blocking=True))
        _, step_s = timed(ctx, lambda: ctx.step(built))
        _, async_s = timed(ctx, lambda: saver.save(blocking=False))
        t0 = time.perf_counter()
        _, step_writing_s = timed(ctx, lambda: ctx.step(built))
        published, wait_s = timed(ctx, saver.wait)
        written_s = time.perf_counter() - t0
        out.note(
            f"{built.spec.num_layers} layer(s), {gib(size)} GiB of checkpointed tensors "
            f"per save, {ctx.precision} on {ctx.device}, written to {tmp}"
        )
        if published is None or not Path(published).is_dir():
            out.fail(f"the asynchronous save published nothing ({published})")
    rows = [
        ["first save, blocking (allocates pinned buffers)", f"{first_s:.3f}", ""],
        ["blocking save", f"{blocking_s:.3f}", ""],
        [
            "asynchronous save",
            f"{async_s:.3f}",
            f"written and published {async_s + written_s:.3f} s after save() began",
        ],
        ["a training step", f"{step_s:.3f}", ""],
        [
            "a training step while the save writes",
            f"{step_writing_s:.3f}",
            f"then wait() held the thread {wait_s:.3f} s",
        ],
    ]
    out.table("Seconds the training thread was held", ["", "seconds", "note"], rows)
    ratio = async_s / blocking_s if blocking_s > 0 else float("inf")
    out.note(f"asynchronous / blocking stall: {ratio:.2f}")
    if ctx.cuda and ratio > STALL_LIMIT:
        out.fail(
            f"the asynchronous save held the training thread {ratio:.0%} as long as the "
            f"blocking one (limit {STALL_LIMIT:.0%})"
        )
