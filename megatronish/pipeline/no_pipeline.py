"""Forward and backward over the microbatches of a step on a single stage (pp = 1)."""

from __future__ import annotations

import torch
from torch import nn

from megatronish.timers import Timers


def forward_backward_no_pipeline(
    chunks: list[nn.Module],
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_scale: float,
    param_hooks=None,
    timers: Timers | None = None,
) -> list[torch.Tensor]:
    """Gradient accumulation: ``loss * loss_scale`` is backpropagated for each microbatch.

    ``param_hooks`` (ZeRO 3) gathers a chunk's params before its forward and backward and
    releases them after. ``timers`` times forward and backward. Returns the detached
    per-microbatch losses.
    """
    (model,) = chunks
    hooks = param_hooks or NO_PARAM_HOOKS
    timers = timers or Timers.off()
    losses = []
    for m, (inputs, targets) in enumerate(microbatches):
        hooks.gather(0)
        with timers.region("forward", "forward mb{} chunk0", m):
            loss = model(inputs, targets)
        hooks.release(0)
        hooks.gather(0)
        with timers.region("backward", "backward mb{} chunk0", m):
            (loss * loss_scale).backward()
        hooks.release(0)
        losses.append(loss.detach())
    return losses


class _NoParamHooks:
    """Params are always materialised (ZeRO 0-2)."""

    def gather(self, chunk_index: int) -> None:
        pass

    def release(self, chunk_index: int) -> None:
        pass


NO_PARAM_HOOKS = _NoParamHooks()
