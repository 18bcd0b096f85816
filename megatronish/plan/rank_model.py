"""A pipeline rank's model chunks on the meta device: the real modules (no memory), tp rank 0's
shards and ep rank 0's experts, for the planner to count and bucket exactly as the trainer
allocates them."""

from __future__ import annotations

from megatronish.distributed.comm import ParallelGroup
from megatronish.model.build import chunk_layer_ranges
from megatronish.model.gpt import GPTChunk
from megatronish.model.parallel_context import ParallelContext
from megatronish.moe.context import EPContext
from megatronish.plan.layout import Layout
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.context import TPContext


def meta_chunks(spec: ModelSpec, layout: Layout, pp_rank: int) -> list[GPTChunk]:
    """Pipeline rank ``pp_rank``'s chunks on the meta device (tp rank 0's shards)."""
    ctx = ParallelContext(
        tp=TPContext(group=ParallelGroup("tp", tuple(range(layout.tp)), 0), sp=layout.sp),
        ep=EPContext(
            group=ParallelGroup("ep", tuple(range(layout.ep)), 0),
            dispatch_order=layout.moe_dispatch_order,
        ),
    )
    ranges = chunk_layer_ranges(layout.chunk_layers(spec.num_layers))
    last = len(ranges) - 1
    return [
        GPTChunk(spec, ctx, ranges[c], first=c == 0, last=c == last, device="meta")
        for c in layout.stage_chunks(pp_rank)
    ]


def chunk_key(layout: Layout, num_layers: int, pp_rank: int) -> tuple:
    """What :func:`meta_chunks` reads (the planner builds them once per key)."""
    placement = layout.chunk_layers(num_layers), tuple(layout.stage_chunks(pp_rank))
    return layout.tp, layout.sp, layout.ep, placement
