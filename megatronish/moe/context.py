"""EPContext: what a mixture-of-experts block needs to know about expert parallelism."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatronish.distributed.comm import ParallelGroup, single_group


@dataclass
class EPContext:
    """The expert-parallel group: the ranks whose mixture-of-experts blocks exchange tokens, each
    holding ``num_experts / size`` of every block's experts."""

    group: ParallelGroup = field(default_factory=lambda: single_group("ep"))

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank
