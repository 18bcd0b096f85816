"""AdamW over flat fp32 shards (the same update as ``torch.optim.AdamW``).

Under ZeRO >= 1 each dp rank keeps Adam moments only for its shard of every bucket; under ZeRO 0
the "shard" is the whole bucket. Weight decay applies on given ranges (not on norms and biases).

The update is torch's fused AdamW kernel (one pass over each tensor, on CPU and GPU) applied to
views of the shards: the runs of decayed elements with the weight decay, the rest without.
"""

from __future__ import annotations

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

    def __init__(self, numels: list[int], device, *, betas, eps: float, weight_decay: float):
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.exp_avg = [torch.zeros(n, device=device) for n in numels]
        self.exp_avg_sq = [torch.zeros(n, device=device) for n in numels]
        self.step_count = 0
        self._step = torch.zeros((), dtype=torch.float32, device=device)  # the kernel reads it

    @torch.no_grad()
    def step(self, shards: list[Shard], lr: float, grad_scale: float = 1.0) -> None:
        """Update every ``param`` in place from ``grad * grad_scale``.

        A ``grad_scale`` other than 1 (clipping, averaging) is applied inside the kernel, on the
        fly, and leaves the grads scaled by it.
        """
        self.step_count += 1
        self._step.fill_(self.step_count)
        groups: dict[bool, tuple[list, list, list, list]] = {
            False: ([], [], [], []),
            True: ([], [], [], []),
        }
        for (param, grad, decay_ranges), m, v in zip(shards, self.exp_avg, self.exp_avg_sq):
            for lo, hi, decayed in decay_runs(param.numel(), decay_ranges):
                for out, t in zip(groups[decayed and self.weight_decay > 0], (param, grad, m, v)):
                    out.append(t[lo:hi])
        # The kernel divides grads by grad_scale (its AMP unscale input).
        inverse = None if grad_scale == 1.0 else self._step.new_tensor(1.0 / grad_scale)
        for decayed, (params, grads, ms, vs) in groups.items():
            if not params:
                continue
            torch._fused_adamw_(
                params, grads, ms, vs, [], [self._step] * len(params),
                lr=lr, beta1=self.beta1, beta2=self.beta2,
                weight_decay=self.weight_decay if decayed else 0.0, eps=self.eps,
                amsgrad=False, maximize=False, grad_scale=inverse, found_inf=None,
            )  # fmt: skip

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq)
