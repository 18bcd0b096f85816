"""AdamW over flat fp32 shards (the same update as ``torch.optim.AdamW``).

Under ZeRO >= 1 each dp rank keeps Adam moments only for its shard of every bucket; under ZeRO 0
the "shard" is the whole bucket. Weight decay applies on given ranges (not on norms and biases).
"""

from __future__ import annotations

import math

import torch


class ShardedAdamW:
    """Decoupled-weight-decay Adam on ``(param, grad, decay_ranges)`` flat tensors."""

    def __init__(self, numels: list[int], device, *, betas, eps: float, weight_decay: float):
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.exp_avg = [torch.zeros(n, device=device) for n in numels]
        self.exp_avg_sq = [torch.zeros(n, device=device) for n in numels]
        self.step_count = 0

    @torch.no_grad()
    def step(self, shards: list[tuple[torch.Tensor, torch.Tensor, list]], lr: float):
        """Update every ``param`` in place from its ``grad``."""
        self.step_count += 1
        c1 = 1 - self.beta1**self.step_count
        c2_sqrt = math.sqrt(1 - self.beta2**self.step_count)
        for (param, grad, decay_ranges), m, v in zip(shards, self.exp_avg, self.exp_avg_sq):
            if self.weight_decay:
                for lo, hi in decay_ranges:
                    param[lo:hi].mul_(1 - lr * self.weight_decay)
            m.lerp_(grad, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
            denom = v.sqrt().div_(c2_sqrt).add_(self.eps)
            param.addcdiv_(m, denom, value=-lr / c1)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq)
