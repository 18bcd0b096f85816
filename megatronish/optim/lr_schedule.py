"""Learning-rate schedule: linear warm-up, then cosine / linear decay, or constant (pure)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatronish.config.schema import OptimizerConfig, SchedulerConfig


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, decay: int, style: str) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Warm-up rises linearly from ``lr / warmup`` to ``lr`` over ``warmup`` steps; then the rate
    decays to ``min_lr`` at step ``decay`` (cosine or linear) and stays there.
    """
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if style == "constant":
        return lr
    span = max(decay - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if style == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def schedule_from_config(
    optimizer_cfg: OptimizerConfig, scheduler_cfg: SchedulerConfig, max_steps: int
) -> Callable[[int], float]:
    """A ``step -> lr`` function from the config groups."""
    decay = scheduler_cfg.decay_steps if scheduler_cfg.decay_steps is not None else max_steps
    return lambda step: lr_at(
        step,
        lr=optimizer_cfg.lr,
        min_lr=scheduler_cfg.min_lr,
        warmup=scheduler_cfg.warmup_steps,
        decay=decay,
        style=scheduler_cfg.style,
    )
