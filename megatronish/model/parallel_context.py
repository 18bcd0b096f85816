"""ParallelContext: the parallel layout as the model sees it, one context per kind of split."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatronish.context_parallel.attention import CPContext
from megatronish.moe.context import EPContext
from megatronish.tensor_parallel.context import TPContext


@dataclass
class ParallelContext:
    """Tensor (and sequence), context and expert parallelism; the defaults are one process.

    The model hands each layer the parts it uses: every layer ``tp``, attention and the position
    tables ``cp`` too, mixture-of-experts blocks ``ep`` (and ``cp``, for their balancing loss).
    """

    tp: TPContext = field(default_factory=TPContext)
    cp: CPContext = field(default_factory=CPContext)
    ep: EPContext = field(default_factory=EPContext)
