"""Forward and backward over the microbatches of a step on a single stage (pp = 1)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from megatronish.distributed.timers import Timers
from megatronish.pipeline.microbatch import Microbatch, microbatch_parts, run_chunk


def forward_backward_no_pipeline(
    chunks: list[nn.Module],
    microbatches: list[Microbatch],
    *,
    loss_scale: float,
    param_hooks: ParamHooks | None = None,
    timers: Timers | None = None,
) -> list[torch.Tensor]:
    """Gradient accumulation: ``loss * loss_scale`` is backpropagated for each microbatch.

    ``param_hooks`` (ZeRO) is told before and after each forward and backward (ZeRO 3
    prefetches the first params a compute needs and frees what it left gathered). ``timers``
    times forward and backward. Returns the detached per-microbatch losses.
    """
    (model,) = chunks
    hooks = param_hooks or NO_PARAM_HOOKS
    timers = timers or Timers.off()
    losses = []
    for m, microbatch in enumerate(microbatches):
        inputs, targets, documents = microbatch_parts(microbatch)
        hooks.prefetch(0, "fwd")
        with timers.region("forward", "forward mb{} chunk0", m):
            loss = run_chunk(model, inputs, targets, documents)
        hooks.after_compute(0, "fwd")
        with timers.region("backward", "backward mb{} chunk0", m):
            (loss * loss_scale).backward()
        hooks.after_compute(0, "bwd")
        losses.append(loss.detach())
    return losses


class ParamHooks(Protocol):
    """Told before (``prefetch``) and after each forward ("fwd") and backward ("bwd") of a
    chunk (ZeRO's parameter gathering)."""

    def prefetch(self, chunk_index: int, kind: str) -> None: ...

    def after_compute(self, chunk_index: int, kind: str) -> None: ...


class _NoParamHooks:
    """Params are always materialised (no ZeRO)."""

    def prefetch(self, chunk_index: int, kind: str) -> None:
        pass

    def after_compute(self, chunk_index: int, kind: str) -> None:
        pass


NO_PARAM_HOOKS = _NoParamHooks()
