"""The ``trainer.fp8`` rules: precision, the blocks kept in bf16, and what fp8 does not
compose with yet."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatronish.config.pipeline_rules import SPLIT_BACKWARD_SCHEDULES

if TYPE_CHECKING:
    from megatronish.config.schema import TrainConfig


def fp8_errors(cfg: TrainConfig, schedule: str | None) -> list[str]:
    """Every ``trainer.fp8`` rule ``cfg`` breaks (``schedule``: the resolved pipeline schedule;
    the recipe's name is checked with the other choices)."""
    t, layers = cfg.trainer, cfg.model.num_layers
    skip = t.fp8_skip_first_last
    if skip < 0:
        return [f"trainer.fp8_skip_first_last={skip} must be >= 0"]
    if t.fp8 is None:
        return []
    errors = []
    if t.precision != "bf16":
        errors.append(
            f"trainer.fp8={t.fp8} needs trainer.precision=bf16 (fp8 GEMMs take and give bf16 "
            "activations; weights and optimizer stay as bf16 training keeps them)"
        )
    if 2 * skip >= layers:
        errors.append(
            f"trainer.fp8_skip_first_last={skip} keeps all {layers} blocks in bf16 (the first and "
            f"last {skip}); lower it below {(layers + 1) // 2} or set trainer.fp8=null"
        )
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        errors.append(
            f"trainer.fp8 does not split its backward for parallel.pipeline_schedule={schedule} "
            "yet; use 1f1b or interleaved, or trainer.fp8=null"
        )
    return errors
