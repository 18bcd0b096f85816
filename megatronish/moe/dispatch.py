"""Token dispatch to the experts of the expert-parallel group, and the way back.

Dispatch sorts this rank's (token, slot) assignments by expert, tells every ep peer how many it
sends to each of the peer's experts (an all-to-all of counts), sends the tokens (an all-to-all,
rows grouped by destination) and regroups what arrives by local expert, so each expert's rows
are contiguous. Combine runs the same steps backwards and sums every token's slots weighted by
its router weights, so tokens come back in their original order exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.distributed.comm import ParallelGroup, all_to_all


class _AllToAll(torch.autograd.Function):
    """Rows ``in_splits`` to each peer, ``out_splits`` from each; backward sends grads back."""

    @staticmethod
    def forward(ctx, x, group: ParallelGroup, out_splits: list[int], in_splits: list[int]):
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        return all_to_all(out, x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        return all_to_all(back, grad, ctx.group, in_splits, out_splits), None, None, None


def exchange(x: torch.Tensor, group: ParallelGroup, out_splits, in_splits) -> torch.Tensor:
    """Differentiable all-to-all of rows over ``group`` (the identity for a group of one)."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits))


def expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Row order that turns a buffer grouped by (source, expert) into one grouped by (expert,
    source); ``counts`` ``[sources, experts]`` are the rows of each chunk (pure)."""
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts).t().reshape(-1)
    sizes = counts.t().reshape(-1)
    offsets = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(offsets, sizes)
    return torch.repeat_interleave(starts, sizes) + within


@dataclass
class Dispatched:
    """What combine needs to undo a dispatch."""

    order: torch.Tensor  # flat (token, slot) assignments sent, sorted by expert
    in_splits: list[int]  # rows sent to each ep peer
    out_splits: list[int]  # rows received from each ep peer
    regroup: torch.Tensor | None  # (source, expert) -> (expert, source) row order; None: ep = 1
    local_counts: list[int]  # rows of each local expert, in order


def dispatch(
    tokens: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    top_k: int,
    group: ParallelGroup,
) -> tuple[torch.Tensor, Dispatched]:
    """Send ``tokens`` ``[T, h]``'s assignments ``order`` (sorted by expert, ``counts`` per
    global expert) to the ep peers that hold their experts; returns the rows of this rank's
    experts grouped by local expert, and the record for :func:`combine`."""
    rows = tokens.index_select(0, order // top_k)
    ep = group.size
    if ep == 1:
        local = counts.tolist()
        return rows, Dispatched(order, [rows.shape[0]], [rows.shape[0]], None, local)
    per_peer = counts.view(ep, -1)
    received = torch.empty_like(counts)
    all_to_all(received, counts, group, [per_peer.shape[1]] * ep, [per_peer.shape[1]] * ep)
    received = received.view(ep, -1)  # [source, local expert]
    in_splits = per_peer.sum(1).tolist()
    out_splits = received.sum(1).tolist()
    arrived = exchange(rows, group, out_splits, in_splits)
    regroup = expert_major(received)
    local = received.sum(0).tolist()
    return arrived.index_select(0, regroup), Dispatched(
        order, in_splits, out_splits, regroup, local
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
        outputs = exchange(outputs.index_select(0, back), group, record.in_splits,
                           record.out_splits)  # fmt: skip
    tokens, top_k = weights.shape
    slots = outputs.new_zeros((tokens * top_k, outputs.shape[-1]))
    slots = slots.index_copy(0, record.order, outputs).view(tokens, top_k, -1)
    return (slots * weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1)
