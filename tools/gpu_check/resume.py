"""Section 4: a checkpoint saved from device tensors resumes bit-exactly.

A two-layer model of the shape (two micro batches a step) trains ``BEFORE`` steps, saves a
checkpoint (``CheckpointSaver``), and trains ``AFTER`` more: the uninterrupted run. A fresh
trainer loads the checkpoint (``load_into``) and trains the same ``AFTER`` steps. Their losses
and final parameters must be identical, bit for bit.

Both runs use deterministic algorithms and the math SDPA backend (on the CPU too, so that the
smoke run takes the same path): on CUDA flash attention's backward accumulates with atomics, so
two uninterrupted runs would already differ in the last bits. The check is about the checkpoint,
not the kernels.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu_check.context import Built, CheckContext
from gpu_check.report import SectionResult
from megatronish.checkpoint.load import load_into
from megatronish.checkpoint.save import CheckpointSaver

NAME = "resume"
TITLE = "Checkpoint and bit-exact resume"
SHARE = 0.1
BEFORE, AFTER = 3, 3
SHOWN = 5  # mismatches listed


@dataclass
class Continuation:
    """The losses of the steps after the checkpoint and the parameters after them (on CPU)."""

    losses: list[float]
    params: dict[str, torch.Tensor]


def compare_continuation(a: Continuation, b: Continuation) -> list[str]:
    """Every difference between two continuations (empty: bit-identical)."""
    problems = []
    if len(a.losses) != len(b.losses):
        problems.append(f"{len(a.losses)} vs {len(b.losses)} steps")
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        if x != y and not (math.isnan(x) and math.isnan(y)):
            problems.append(f"loss of step +{i + 1}: {x!r} vs {y!r}")
    if set(a.params) != set(b.params):
        problems.append(f"parameter names differ: {sorted(set(a.params) ^ set(b.params))[:SHOWN]}")
    for name in sorted(set(a.params) & set(b.params)):
        x, y = a.params[name], b.params[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            problems.append(f"{name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        elif not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item()
            problems.append(f"{name}: max |difference| {diff:.3e}")
    return problems


@contextlib.contextmanager
def reproducible() -> Iterator[None]:
    """Deterministic kernels and math attention (see the module docstring)."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # same kernels, no extra fills
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]


def continue_run(ctx: CheckContext, built: Built) -> Continuation:
    losses = [ctx.step(built).loss for _ in range(AFTER)]
    params = {
        n: p.detach().cpu().clone() for c in built.trainer.chunks for n, p in c.named_parameters()
    }
    return Continuation(losses, params)


def run(ctx: CheckContext, out: SectionResult) -> None:
    with tempfile.TemporaryDirectory(prefix="gpu_check_ckpt_") as tmp, reproducible():
        overrides = [*ctx.small(microbatches=2), f"checkpoint.dir={tmp}"]
        first = ctx.build(overrides)
        device = first.trainer.topo.device
        out.note(
            f"{first.spec.num_layers} layers, 2 micro batches a step, {ctx.precision} on "
            f"{device}, deterministic algorithms, math attention"
        )
        for _ in range(BEFORE):
            ctx.step(first)
        path = CheckpointSaver(first.cfg, first.trainer.checkpoint_parts).save(blocking=True)
        out.note(f"saved step {BEFORE}: {path}")
        uninterrupted = continue_run(ctx, first)
        del first
        ctx.release()
        second = ctx.build(overrides)
        load_into(second.trainer.checkpoint_parts, path)
        if second.trainer.state.step != BEFORE:
            out.fail(f"the loaded trainer is at step {second.trainer.state.step}, not {BEFORE}")
        resumed = continue_run(ctx, second)
    rows = [
        [str(BEFORE + i + 1), repr(a), repr(b), "yes" if a == b else "NO"]
        for i, (a, b) in enumerate(zip(uninterrupted.losses, resumed.losses))
    ]
    out.table("Losses after the checkpoint", ["step", "uninterrupted", "resumed", "equal"], rows)
    problems = compare_continuation(uninterrupted, resumed)
    if problems:
        out.fail(f"{len(problems)} difference(s): " + "; ".join(problems[:SHOWN]))
    else:
        out.note(f"losses and all {len(resumed.params)} parameter tensors are bit-identical")
