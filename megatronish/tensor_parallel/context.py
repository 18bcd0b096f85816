"""TPContext: what a model layer needs to know about tensor and sequence parallelism."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatronish.distributed.comm import ParallelGroup, single_group
from megatronish.tensor_parallel.random import RNGTracker


@dataclass
class TPContext:
    """The tp group, whether sequence parallelism is on, and the RNG tracker for dropout."""

    group: ParallelGroup = field(default_factory=lambda: single_group("tp"))
    sp: bool = False
    rng: RNGTracker | None = None

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def sequence_parallel(self) -> bool:
        return self.sp and self.group.size > 1

    def dropout(self, x: torch.Tensor, p: float, training: bool, split: bool) -> torch.Tensor:
        """Dropout; ``split`` activations (different on each tp rank) use the ``tp`` generator."""
        if p == 0.0 or not training:
            return x
        if split and self.rng is not None and self.group.size > 1:
            with self.rng.fork("tp"):
                return F.dropout(x, p, training=True)
        return F.dropout(x, p, training=True)
