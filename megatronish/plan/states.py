"""Bytes of parameters, gradients and optimizer state per rank, from the real model on meta.

The rank's chunks are built on the meta device (no memory) and grouped into the same buckets as
:class:`~megatronish.optim.zero.ZeroDataParallel` would, so padding, tied copies and replicated
norms are counted exactly as the trainer allocates them. Grads and both Adam moments are fp32;
under bf16 the model's params are bf16 and the optimizer keeps fp32 main params of its shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.distributed.comm import ParallelGroup
from megatronish.model.build import chunk_ids_of_stage, chunk_layer_ranges
from megatronish.model.gpt import GPTChunk
from megatronish.model.spec import ModelSpec
from megatronish.optim.buckets import plan_buckets
from megatronish.plan.layout import Layout
from megatronish.tensor_parallel.context import TPContext

FP32 = 4


@dataclass(frozen=True)
class StateBytes:
    """One rank's states. ``*_step`` adds what exists only during forward/backward."""

    param_numel: int  # parameters of this rank's chunks (a tp shard of each)
    buffer_numel: int  # the same, padded per bucket to a multiple of dp
    largest_bucket_numel: int
    params: int  # between steps
    grads: int  # between steps
    optimizer: int
    params_step: int  # zero 3: full params gathered for the chunk(s) being computed
    grads_step: int  # zero 2/3: full grad buffers while accumulating

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total_step(self) -> int:
        return self.total + self.params_step + self.grads_step


def meta_chunks(spec: ModelSpec, layout: Layout, pp_rank: int) -> list[GPTChunk]:
    """Pipeline rank ``pp_rank``'s chunks on the meta device (tp rank 0's shards)."""
    tp = TPContext(group=ParallelGroup("tp", tuple(range(layout.tp)), 0), sp=layout.sp)
    ranges = chunk_layer_ranges(layout.chunk_layers(spec.num_layers))
    last = len(ranges) - 1
    return [
        GPTChunk(spec, tp, ranges[c], first=c == 0, last=c == last, device="meta")
        for c in chunk_ids_of_stage(pp_rank, layout.pp, layout.vpp)
    ]


def chunk_bucket_numels(chunk: GPTChunk, layout: Layout) -> list[int]:
    """Padded numel of each bucket of one chunk, as the trainer groups them."""
    tie = chunk.spec.tie_embeddings and layout.pp > 1

    def is_tied(name, p) -> bool:
        return (tie and name == "embedding.word.weight") or bool(getattr(p, "tied_to", None))

    buckets = plan_buckets(
        list(chunk.named_parameters()), int(layout.bucket_size_mb * 2**20), layout.dp, 0,
        is_tied, torch.device("meta"),
    )  # fmt: skip
    return [b.numel for b in buckets]


def state_bytes(
    spec: ModelSpec, layout: Layout, pp_rank: int, chunks: list[GPTChunk] | None = None
) -> StateBytes:
    """Params, grads and Adam moments held by a rank of pipeline stage ``pp_rank``
    (``chunks``: that rank's :func:`meta_chunks`, when the caller has them already)."""
    chunks = chunks if chunks is not None else meta_chunks(spec, layout, pp_rank)
    per_chunk = [chunk_bucket_numels(c, layout) for c in chunks]
    numel = sum(sum(n) for n in per_chunk)
    param_numel = sum(p.numel() for c in chunks for p in c.parameters())
    dp, zero = layout.dp, layout.zero_stage
    shard = numel // dp
    owned = numel if zero == 0 else shard
    model = layout.activation_bytes  # the model's params: fp32, or bf16 beside fp32 main params
    params = (shard if zero == 3 else numel) * model + (owned * FP32 if model != FP32 else 0)
    grads = {0: numel, 1: numel, 2: shard, 3: shard}[zero] * FP32
    grads_step = numel * FP32 if zero >= 2 else 0
    params_step = 0
    if zero == 3:
        gathered = numel if layout.zero3_keep_gathered else max(sum(n) for n in per_chunk)
        params_step = gathered * model
    return StateBytes(
        param_numel=param_numel,
        buffer_numel=numel,
        largest_bucket_numel=max(max(n) for n in per_chunk),
        params=params,
        grads=grads,
        optimizer=2 * owned * FP32,
        params_step=params_step,
        grads_step=grads_step,
    )
