"""EPContext: what a mixture-of-experts block needs to know about expert parallelism."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatronish.distributed.comm import ParallelGroup, single_group


@dataclass
class EPContext:
    """The expert-parallel group: the ranks whose mixture-of-experts blocks exchange tokens, each
    holding ``num_experts / size`` of every block's experts."""

    group: ParallelGroup = field(default_factory=lambda: single_group("ep"))
    # Under tp > 1: tp_first gathers the tokens over tp, then exchanges them over ep;
    # ep_first (Megatron-LM's) exchanges each tp rank's own tokens, then gathers the rows over tp.
    dispatch_order: str = "tp_first"
    # the shared experts' forward runs while the tokens' all-to-all is in flight
    overlap_shared: bool = True

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank
