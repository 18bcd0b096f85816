"""Token dispatch to the experts of the expert-parallel group, and the way back.

Dispatch sorts this rank's (token, slot) assignments by expert, tells every ep peer how many it
sends to each of the peer's experts (an all-to-all of counts), sends the tokens (an all-to-all,
rows grouped by destination) and regroups what arrives by local expert, so each expert's rows
are contiguous. Combine runs the same steps backwards and sums every token's slots weighted by
its router weights, so tokens come back in their original order exactly.

The host reads the device once per dispatch, as Megatron-LM does: one copy of a single tensor
holding every count it needs (sent and received), from which the split sizes, the rows per
local expert and every output size follow; the rest stays on the device (``repeat_interleave``
with ``output_size``, the experts' group offsets by a cumulative sum).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatronish.distributed.comm import ParallelGroup, all_to_all

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


class _AllToAll(torch.autograd.Function):
    """Rows ``in_splits`` to each peer, ``out_splits`` from each; backward sends grads back."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        group: ParallelGroup,
        out_splits: list[int],
        in_splits: list[int],
    ):
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        return all_to_all(out, x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        return all_to_all(back, grad, ctx.group, in_splits, out_splits), None, None, None


def exchange(
    x: torch.Tensor, group: ParallelGroup, out_splits: Sequence[int], in_splits: Sequence[int]
) -> torch.Tensor:
    """Differentiable all-to-all of rows over ``group`` (the identity for a group of one)."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits))


def expert_major(counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Row order that turns a buffer grouped by (source, expert) into one grouped by (expert,
    source); ``counts`` ``[sources, experts]`` are the rows of each chunk (pure). ``total``:
    ``counts.sum()`` when the host knows it (else it is read from the device)."""
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts).t().reshape(-1)
    sizes = counts.t().reshape(-1)
    offsets = torch.cumsum(sizes, 0) - sizes
    if total is None:
        total = int(sizes.sum())
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        offsets, sizes, output_size=total
    )
    return torch.repeat_interleave(starts, sizes, output_size=total) + within


@dataclass
class Dispatched:
    """What combine needs to undo a dispatch."""

    order: torch.Tensor  # flat (token, slot) assignments sent, sorted by expert
    in_splits: list[int]  # rows sent to each ep peer
    out_splits: list[int]  # rows received from each ep peer
    regroup: torch.Tensor | None  # (source, expert) -> (expert, source) row order; None: ep = 1
    local_counts: list[int]  # rows of each local expert, in order
    local_ends: torch.Tensor  # their end rows, int32 on the device (grouped matmuls' offsets)


def dispatch(
    tokens: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    top_k: int,
    group: ParallelGroup,
) -> tuple[torch.Tensor, Dispatched]:
    """Send ``tokens`` ``[T, h]``'s assignments ``order`` (sorted by expert, ``counts`` per
    global expert; any dropped ones after ``counts.sum()``) to the ep peers that hold their
    experts; returns the rows of this rank's experts grouped by local expert, and the record for
    :func:`combine`. The host reads the device once: every count, in one copy."""
    ep = group.size
    if ep == 1:
        local = counts.tolist()  # the one host copy
        order = order[: sum(local)]
        rows = tokens.index_select(0, order // top_k)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        return rows, Dispatched(order, [rows.shape[0]], [rows.shape[0]], None, local, ends)
    per_peer = counts.shape[0] // ep
    received = torch.empty_like(counts)
    all_to_all(received, counts, group, [per_peer] * ep, [per_peer] * ep)
    host = torch.cat([counts, received]).tolist()  # the one host copy: sent and received
    sent, got = host[: counts.shape[0]], host[counts.shape[0] :]
    in_splits = [sum(sent[p * per_peer : (p + 1) * per_peer]) for p in range(ep)]
    out_splits = [sum(got[p * per_peer : (p + 1) * per_peer]) for p in range(ep)]
    local = [sum(got[p * per_peer + e] for p in range(ep)) for e in range(per_peer)]
    order = order[: sum(in_splits)]
    arrived = exchange(tokens.index_select(0, order // top_k), group, out_splits, in_splits)
    received = received.view(ep, -1)  # [source, local expert]
    regroup = expert_major(received, total=sum(out_splits))
    ends = torch.cumsum(received.sum(0), 0).to(torch.int32)
    return arrived.index_select(0, regroup), Dispatched(
        order, in_splits, out_splits, regroup, local, ends
    )


def combine(
    outputs: torch.Tensor,
    record: Dispatched,
    weights: torch.Tensor,
    group: ParallelGroup,
) -> torch.Tensor:
    """The experts' ``outputs`` (rows as :func:`dispatch` returned them) back to their tokens:
    ``sum_slot weight * output``, ``[T, h]`` in the original token order. Dropped slots add 0."""
    if record.regroup is not None:
        back = torch.empty_like(record.regroup)
        back[record.regroup] = torch.arange(record.regroup.numel(), device=back.device)
        outputs = exchange(
            outputs.index_select(0, back), group, record.in_splits, record.out_splits
        )
    tokens, top_k = weights.shape
    slots = outputs.new_zeros((tokens * top_k, outputs.shape[-1]))
    slots = slots.index_copy(0, record.order, outputs).view(tokens, top_k, -1)
    return (slots * weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1)
