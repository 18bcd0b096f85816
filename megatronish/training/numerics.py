"""Non-finite training steps: the error that ends a run after too many in a row.

A step whose loss or global grad norm is not finite is skipped on every rank (the optimizer
state is left untouched); ``trainer.max_skipped_steps`` such steps in a row stop the run with
:class:`TooManySkippedSteps`, which ``megatronish/train.py`` maps to exit code 5.
"""

from __future__ import annotations


class TooManySkippedSteps(RuntimeError):
    """``trainer.max_skipped_steps`` steps in a row had a non-finite loss or grad norm."""


def skip_limit_message(step: int, limit: int, grad_norm: float, loss: float | None) -> str:
    """Why the run stops after ``limit`` skipped steps in a row, and what to do."""
    last = f"grad norm {grad_norm}" + ("" if loss is None else f", loss {loss}")
    return (
        f"stopping at step {step}: {limit} steps in a row had a non-finite loss or grad norm "
        f"(trainer.max_skipped_steps={limit}; last: {last}). Checkpoints are not saved while "
        "steps are skipped, so the latest one predates the fault: resume from it with a lower "
        "optimizer.lr, other data or a longer warm-up"
    )
