"""A tiny llama cut into pipeline chunks (hidden 32, microbatches of 2 x 8 tokens) and one
recorded step of it: what the engine's multi-process tests run in a world of ``pp`` ranks."""

from __future__ import annotations

import torch
from torch import nn

from megatronish.config.pipeline_rules import resolve_pipeline_schedule
from megatronish.distributed.topology import Topology
from megatronish.model.build import build_chunks
from megatronish.model.parallel_context import ParallelContext
from megatronish.pipeline.engine import (
    PipelineShape,
    Timeline,
    attach_split_backward,
    forward_backward_pipeline,
)
from megatronish.pipeline.schedule import splits_backward, v_shape
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.weight_grad import WeightGradStore

SHAPE = PipelineShape((8, 2, 32))  # [seq, micro batch, hidden] of every stage's activation


def tiny_chunks(rank: int, pp: int, vpp: int, layers: int = 4, v: bool = False) -> list[nn.Module]:
    """Pipeline rank ``rank``'s chunks of the tiny llama, its ``layers`` split evenly over the
    ``pp * vpp`` chunks (``v``: the zbv placement)."""
    spec = ModelSpec(
        arch="llama",
        num_layers=layers,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=64,
        seq_length=8,
        vocab_size=64,
        padded_vocab_size=128,
        max_position_embeddings=8,
    )
    split = [layers // (pp * vpp)] * (pp * vpp)
    return build_chunks(spec, ParallelContext(), split, rank, pp, vpp, v_shape=v)


def tiny_batches(m: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``m`` microbatches of random ids (the same tensor as inputs and targets)."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 64, (2, 8), generator=gen),) * 2 for _ in range(m)]


def tiny_pipeline_step(
    rank: int, world: int, vpp: int, schedule: str | None = None
) -> list[tuple[str, float, float]]:
    """The timeline events of one step of ``schedule`` (4 microbatches) with ``vpp`` chunks per
    rank; raises if a split schedule left weight grads unrun."""
    schedule = resolve_pipeline_schedule(schedule, vpp)
    topo = Topology.build(tp=1, dp=1, pp=world, rank=rank)
    chunks = tiny_chunks(rank, world, vpp, v=v_shape(schedule))
    store = WeightGradStore() if splits_backward(schedule) else None
    attach_split_backward(chunks, store)
    batches = tiny_batches()
    timeline = Timeline()
    forward_backward_pipeline(
        chunks,
        batches,
        loss_scale=1.0 / len(batches),
        topo=topo,
        vpp=vpp,
        shape=SHAPE,
        timeline=timeline,
        schedule=schedule,
        weight_grads=store,
    )
    if store is not None and store.pending:
        raise AssertionError(f"weight grads never run: {store.pending}")
    return timeline.events
