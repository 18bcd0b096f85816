"""Data-parallel gradient averaging (ZeRO stage 0): one reduction per step, after accumulation."""

from __future__ import annotations

from torch import nn

from megatronish.distributed.comm import ParallelGroup
from megatronish.optim.grads import flat_all_reduce, params_of


class DataParallelGrads:
    """Averages grads over the dp group once per step (never during earlier microbatches)."""

    def __init__(self, chunks: list[nn.Module], group: ParallelGroup):
        self.params = [p for _, p in params_of(chunks)]
        self.group = group

    def start_last_microbatch(self) -> None:
        """Called before the last microbatch's backward (the hook point for overlapped buckets)."""

    def reduce(self) -> None:
        if self.group.size == 1:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        flat_all_reduce(grads, self.group)
        for g in grads:
            g.div_(self.group.size)
