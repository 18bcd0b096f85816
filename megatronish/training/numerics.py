"""Non-finite training steps, and a step's outcome as the host learns it.

A step whose loss or global grad norm is not finite is skipped on every rank: the optimizer
update is a no-op decided on the device (see :mod:`megatronish.optim.sharded_adamw`), so the
host reads nothing during the step. Its loss and grad norm wait in a :class:`StepResult` until
the host needs them (a log step, a checkpoint, a stop, the end of the run, or at the latest the
next step, once that step's forward and backward are queued); then the trainer counts the skip,
and ``trainer.max_skipped_steps`` such steps in a row stop the run with
:class:`TooManySkippedSteps`, which ``megatronish/train.py`` maps to exit code 5.

How the host reads them (:func:`queue_host_copy`, :func:`read_on_host`): on CUDA the step queues
a ``non_blocking`` copy of its ``[loss, grad norm]`` into a pinned host buffer as soon as the
norm is computed, and records an event after it; reading waits for that event only, i.e. for the
step's own forward, backward and norm, never for the work queued after them (the update, the
next step's forward and backward), so the GPU keeps that queue while the host waits. On CPU
(no copy layer) the values are read from the "device" tensors directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from megatronish.checkpoint.host_copies import CopyEvent, HostCopies


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


class StepResult:
    """One optimizer step: ``step`` and ``lr`` on the host; ``loss`` (the global batch's mean,
    nan on ranks without the loss), ``grad_norm`` (before clipping) and ``skipped`` (the norm
    is not finite) read from the device when first asked for.

    Reading one settles this step and every earlier one through ``settle`` (the trainer's):
    the skipped-step accounting runs then and may raise :class:`TooManySkippedSteps`.
    ``copied``: the host buffer a queued copy fills and the event after it (None: read
    ``on_device`` directly).
    """

    __slots__ = ("step", "lr", "on_device", "copied", "_settle", "_host")

    def __init__(
        self,
        step: int,
        lr: float,
        on_device: torch.Tensor,
        settle: Callable[[], None],
        copied: tuple[torch.Tensor, CopyEvent] | None = None,
    ) -> None:
        self.step, self.lr = step, lr
        # [loss, grad norm] until settled (also kept alive for the copy that reads it)
        self.on_device: torch.Tensor | None = on_device
        self.copied = copied
        self._settle: Callable[[], None] | None = settle
        self._host: tuple[float, float] | None = None

    @property
    def settled(self) -> bool:
        return self._host is not None

    def resolve(self, loss: float, grad_norm: float) -> None:
        """The values read from the device (the trainer's settle)."""
        self._host = (loss, grad_norm)
        self.on_device = self.copied = self._settle = None

    def _values(self) -> tuple[float, float]:
        if self._host is None and self._settle is not None:
            self._settle()
        if self._host is None:
            raise RuntimeError(f"step {self.step} was never settled: the run stopped before it")
        return self._host

    @property
    def loss(self) -> float:
        return self._values()[0]

    @property
    def grad_norm(self) -> float:
        return self._values()[1]

    @property
    def skipped(self) -> bool:
        return not math.isfinite(self._values()[1])

    def __repr__(self) -> str:
        if self._host is None:
            return f"StepResult(step={self.step}, lr={self.lr}, unsettled)"
        loss, norm = self._host
        return f"StepResult(step={self.step}, loss={loss}, grad_norm={norm}, lr={self.lr})"


def queue_host_copy(
    copies: HostCopies | None, on_device: torch.Tensor
) -> tuple[torch.Tensor, CopyEvent] | None:
    """Queue the copy of a step's ``[loss, grad norm]`` to the host, after the work queued so
    far, without waiting: ``(host buffer, event)``, the buffer valid once the event completes
    (None without a copy layer). One host buffer serves every step: the trainer settles the
    previous step (reads its buffer) before it queues the next copy."""
    if copies is None:
        return None
    copies.follow_training()
    host = copies.to_host(on_device, "step result")
    return host, copies.record()


def read_on_host(results: Sequence[StepResult]) -> list[tuple[float, float]]:
    """``(loss, grad norm)`` of each result. A copied one waits for its copy's event (its own
    step's work, not what was queued after it) and reads the host buffer; the others are read
    from the device, all in one read."""
    direct = [r.on_device for r in results if r.copied is None]
    flat = iter(torch.cat(direct).tolist() if direct else [])
    values = []
    for r in results:
        if r.copied is None:
            values.append((next(flat), next(flat)))
        else:
            host, event = r.copied
            event.synchronize()
            loss, norm = host.tolist()
            values.append((loss, norm))
    return values
