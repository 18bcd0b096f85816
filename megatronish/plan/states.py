"""Bytes of parameters, gradients and optimizer state per rank, from the real model on meta.

The rank's chunks are built on the meta device (no memory) and grouped into the same buckets as
:class:`~megatronish.data_parallel.zero.ZeroDataParallel` would, so padding, tied copies and
replicated norms are counted exactly as the trainer allocates them. Grads and both Adam moments
are fp32; under bf16 the model's params are bf16 and the optimizer keeps fp32 main params of its
shard.
Experts (mixture-of-experts blocks) are split over ep, and their buckets are sharded over the
expert-data-parallel ranks (``dp * cp / ep``) instead of dp x cp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.data_parallel.buckets import Bucket, plan_chunk_buckets
from megatronish.data_parallel.grad_reduce import MAX_IN_FLIGHT
from megatronish.data_parallel.grads import tied_rule
from megatronish.distributed.comm import ParallelGroup
from megatronish.model.build import chunk_ids_of_stage, chunk_layer_ranges
from megatronish.model.gpt import GPTChunk
from megatronish.model.spec import ModelSpec
from megatronish.plan.layout import Layout
from megatronish.plan.zero3_gather import chunk_units, expert_dp, rank_peak_gathered
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
    params_step: int  # zero 3: most full params gathered at once (units, prefetch included)
    grads_step: int  # zero 2/3: most full grad buffers alive at once (in a backward)
    grads_at_peak: int = 0  # zero 2/3: those alive when activations peak (see state_bytes)
    largest_shard_numel: int = 0  # the largest bucket's slice a rank owns under zero >= 1
    experts: int = 0  # of ``total``: the experts' params, grads and Adam moments

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total_step(self) -> int:
        """States at the activation peak of a step."""
        return self.total + self.params_step + self.grads_at_peak


def meta_chunks(spec: ModelSpec, layout: Layout, pp_rank: int) -> list[GPTChunk]:
    """Pipeline rank ``pp_rank``'s chunks on the meta device (tp rank 0's shards)."""
    tp = TPContext(
        group=ParallelGroup("tp", tuple(range(layout.tp)), 0),
        sp=layout.sp,
        ep=ParallelGroup("ep", tuple(range(layout.ep)), 0),
    )
    ranges = chunk_layer_ranges(layout.chunk_layers(spec.num_layers))
    last = len(ranges) - 1
    return [
        GPTChunk(spec, tp, ranges[c], first=c == 0, last=c == last, device="meta")
        for c in chunk_ids_of_stage(pp_rank, layout.pp, layout.vpp)
    ]


def chunk_buckets(chunk: GPTChunk, layout: Layout) -> list[Bucket]:
    """One chunk's buckets (on meta), as the trainer groups them."""
    return plan_chunk_buckets(
        chunk,
        int(layout.bucket_size_mb * 2**20),
        layout.dp_cp,
        0,
        tied_rule(chunk.spec.tie_embeddings, layout.pp),
        torch.device("meta"),
        per_unit=layout.zero_stage >= 2,
        **expert_dp(layout),
    )


def step_grad_numel(buckets_of: list[list[Bucket]]) -> int:
    """Zero 2/3: most full-grad elements alive at once in a step: every late bucket (reduced at
    the end) and, of the others (reduced per microbatch, in backward order, all finished when a
    chunk's backward ends), the one filling plus the ``MAX_IN_FLIGHT`` reductions before it."""
    late = sum(b.numel for bs in buckets_of for b in bs if b.late)
    window = MAX_IN_FLIGHT + 1
    runs = [[b.numel for b in bs if not b.late] for bs in buckets_of]
    most = max((sum(r[i : i + window]) for r in runs for i in range(len(r))), default=0)
    return late + most


def state_bytes(
    spec: ModelSpec, layout: Layout, pp_rank: int, chunks: list[GPTChunk] | None = None
) -> StateBytes:
    """Params, grads and Adam moments held by a rank of pipeline stage ``pp_rank``
    (``chunks``: that rank's :func:`meta_chunks`, when the caller has them already)."""
    chunks = chunks if chunks is not None else meta_chunks(spec, layout, pp_rank)
    buckets = [chunk_buckets(c, layout) for c in chunks]
    per_chunk = [[b.numel for b in bs] for bs in buckets]
    numel = sum(sum(n) for n in per_chunk)
    param_numel = sum(p.numel() for c in chunks for p in c.parameters())
    zero = layout.zero_stage  # ZeRO shards over dp x cp (experts: over dp x cp / ep)
    model = layout.activation_bytes  # the model's params: fp32, or bf16 beside fp32 main params
    params, grads, optimizer = _held(buckets, zero, model)
    experts = sum(_held([[b for bs in buckets for b in bs if b.expert]], zero, model))
    grads_step = step_grad_numel(buckets) * FP32 if zero >= 2 else 0
    # Activations peak at the end of a forward, when only the late buckets (reduced at the end
    # of the step) hold full grads; under full recompute they peak in backward, beside the rest.
    late = sum(b.numel for bs in buckets for b in bs if b.late) * FP32 if zero >= 2 else 0
    grads_at_peak = grads_step if layout.recompute == "full" else late
    params_step = 0
    if zero == 3:
        units = [
            chunk_units(c, layout, tied_rule(c.spec.tie_embeddings, layout.pp)) for c in chunks
        ]
        params_step = rank_peak_gathered(units, layout.zero3_keep_gathered) * model
    return StateBytes(
        param_numel=param_numel,
        buffer_numel=numel,
        largest_bucket_numel=max(max(n) for n in per_chunk),
        params=params,
        grads=grads,
        optimizer=optimizer,
        params_step=params_step,
        grads_step=grads_step,
        grads_at_peak=grads_at_peak,
        largest_shard_numel=max(b.numel // b.dp for bs in buckets for b in bs),
        experts=experts,
    )


def _held(buckets: list[list[Bucket]], zero: int, model: int) -> tuple[int, int, int]:
    """Bytes of params, grads and Adam moments of ``buckets`` between steps (a rank's shard of
    each bucket: ``numel / dp`` of the ranks it is sharded over)."""
    numel = sum(b.numel for bs in buckets for b in bs)
    shard = sum(b.numel // b.dp for bs in buckets for b in bs)
    owned = numel if zero == 0 else shard
    params = (shard if zero == 3 else numel) * model + (owned * FP32 if model != FP32 else 0)
    grads = {0: numel, 1: numel, 2: shard, 3: shard}[zero] * FP32
    return params, grads, 2 * owned * FP32
