"""Forward and backward over the microbatches of a step on a single stage (pp = 1)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def forward_backward_no_pipeline(
    chunks: list[nn.Module],
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_scale: float,
    autocast=contextlib.nullcontext,
    on_last_backward=None,
) -> list[torch.Tensor]:
    """Gradient accumulation: ``loss * loss_scale`` is backpropagated for each microbatch.

    ``on_last_backward`` runs just before the last microbatch's backward (data-parallel layers
    use it to start reductions only then). Returns the detached per-microbatch losses.
    """
    (model,) = chunks
    losses = []
    for i, (inputs, targets) in enumerate(microbatches):
        with autocast():
            loss = model(inputs, targets)
        if on_last_backward is not None and i == len(microbatches) - 1:
            on_last_backward()
        (loss * loss_scale).backward()
        losses.append(loss.detach())
    return losses
