"""One plain-PyTorch training step of the reference GPT (or its DTensor-parallel version)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from mish import batch
from torch import nn

from megatronish.testing.reference_gpt import build_adamw


@dataclass
class ReferenceRun:
    """``step()``: batch -> forward -> backward -> clip grad norm -> AdamW, like the Trainer.

    ``context`` wraps forward and backward (DTensor's ``loss_parallel``); ``clip`` clips the
    grads to ``grad_clip`` (``torch.nn.utils.clip_grad_norm_`` unless given).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: object
    batch_size: int
    grad_clip: float = 1.0
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    clip: Callable[[list[nn.Parameter], float], object] | None = None
    step_index: int = field(default=0)

    def step(self) -> float:
        inputs, targets = batch(self.data, self.step_index, self.batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        with self.context():
            loss = self.model(inputs, targets)
            loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        (self.clip or torch.nn.utils.clip_grad_norm_)(params, self.grad_clip)
        self.optimizer.step()
        self.step_index += 1
        return loss.item()


def make_reference_run(model: nn.Module, cfg, data, clip=None, context=None) -> ReferenceRun:
    """A run with the optimizer settings of the megatronish config ``cfg``."""
    o = cfg.optimizer
    opt = build_adamw(model, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps)
    return ReferenceRun(
        model, opt, data, cfg.trainer.global_batch_size, o.grad_clip,
        context=context or contextlib.nullcontext, clip=clip,
    )  # fmt: skip
