"""AdamW over flat fp32 shards (the same update as ``torch.optim.AdamW``).

Under ZeRO >= 1 each dp rank keeps Adam moments only for its shard of every bucket; under ZeRO 0
the "shard" is the whole bucket. Weight decay applies on given ranges (not on norms and biases).

The update is torch's fused AdamW kernel (one pass over each tensor, on CPU and GPU) applied to
views of the shards: the runs of decayed elements with the weight decay, the rest without.
The clip factor and the skip of a non-finite step reach the kernel as device tensors
(``grad_scale``, ``found_inf``), so an update never waits for the host to read the grad norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Shard = tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]


def decay_runs(numel: int, decay_ranges: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """``(start, end, decayed)`` runs that cover ``[0, numel)``, empty runs left out."""
    runs, pos = [], 0
    for lo, hi in sorted(decay_ranges):
        if lo > pos:
            runs.append((pos, lo, False))
        if hi > lo:
            runs.append((lo, hi, True))
        pos = max(pos, hi)
    if pos < numel:
        runs.append((pos, numel, False))
    return runs


class ShardedAdamW:
    """Decoupled-weight-decay Adam on ``(param, grad, decay_ranges)`` flat tensors."""

    def __init__(
        self,
        numels: list[int],
        device: torch.device | str,
        *,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ) -> None:
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.exp_avg = [torch.zeros(n, device=device) for n in numels]
        self.exp_avg_sq = [torch.zeros(n, device=device) for n in numels]
        # Updates applied so far, on the device: the kernel reads it, a skipped update leaves it.
        self._step = torch.zeros((), dtype=torch.float32, device=device)
        self._fences: list[Callable[[], None]] = []  # run once before the next update

    def before_next_update(self, fence: Callable[[], None]) -> None:
        """Call ``fence`` once, before the next :meth:`step` writes params and moments (an async
        checkpoint orders its device->host copies of them first, without a host wait)."""
        self._fences.append(fence)

    @property
    def step_count(self) -> int:
        """Updates applied so far (a device read: for checkpoints and tests, not every step)."""
        return int(self._step.item())

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._step.fill_(value)

    @property
    def steps_on_device(self) -> torch.Tensor:
        """:attr:`step_count` as the device tensor the updates advance: copy it to read it
        without a host wait (the next update writes it only after its fences)."""
        return self._step

    @torch.no_grad()
    def step(
        self,
        shards: list[Shard],
        lr: float,
        grad_scale: torch.Tensor | float | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Update every ``param`` in place from ``grad * grad_scale``, without a host read.

        ``grad_scale`` (clipping, averaging; a 0-dim fp32 tensor on the device, or a float) is
        applied inside the kernel, on the fly, and leaves the grads scaled by it. ``found_inf``
        (a 0-dim fp32 tensor on the device): 1.0 makes the whole update a no-op, params, moments
        and step count untouched, as torch's fused AdamW does under AMP.
        """
        fences, self._fences = self._fences, []
        for fence in fences:
            fence()
        if found_inf is None:
            self._step.add_(1)
        else:
            self._step.add_(1 - found_inf)
        groups: dict[bool, tuple[list, list, list, list]] = {
            False: ([], [], [], []),
            True: ([], [], [], []),
        }
        for (param, grad, decay_ranges), m, v in zip(shards, self.exp_avg, self.exp_avg_sq):
            for lo, hi, decayed in decay_runs(param.numel(), decay_ranges):
                for out, t in zip(groups[decayed and self.weight_decay > 0], (param, grad, m, v)):
                    out.append(t[lo:hi])
        # The kernel divides grads by grad_scale (its AMP unscale input).
        inverse = None
        if isinstance(grad_scale, torch.Tensor):
            inverse = grad_scale.float().reciprocal()
        elif grad_scale is not None and grad_scale != 1.0:
            inverse = torch.full_like(self._step, 1.0 / grad_scale)  # a fill, not a host copy
        for decayed, (params, grads, ms, vs) in groups.items():
            if not params:
                continue
            torch._fused_adamw_(
                params,
                grads,
                ms,
                vs,
                [],
                [self._step] * len(params),
                lr=lr,
                beta1=self.beta1,
                beta2=self.beta2,
                weight_decay=self.weight_decay if decayed else 0.0,
                eps=self.eps,
                amsgrad=False,
                maximize=False,
                grad_scale=inverse,
                found_inf=found_inf,
            )

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq)
