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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatronish.distributed.comm import (
    ParallelGroup,
    all_gather_dim0,
    all_gather_uneven,
    all_to_all,
    reduce_scatter_uneven,
)

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


class _AllToAll(torch.autograd.Function):
    """Rows ``in_splits`` to each peer, ``out_splits`` from each; backward sends grads back.
    With a ``pending`` list the forward posts without waiting: the handle goes there and the
    output is filled once it is waited (the backward waits as usual)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        group: ParallelGroup,
        out_splits: list[int],
        in_splits: list[int],
        pending: list | None = None,
    ):
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = all_to_all(out, x, group, out_splits, in_splits, async_op=pending is not None)
        if pending is None:
            return work
        pending.append(work)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        return all_to_all(back, grad, ctx.group, in_splits, out_splits), None, None, None, None


def exchange(
    x: torch.Tensor, group: ParallelGroup, out_splits: Sequence[int], in_splits: Sequence[int]
) -> torch.Tensor:
    """Differentiable all-to-all of rows over ``group`` (the identity for a group of one)."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits))


def exchange_during(
    x: torch.Tensor,
    group: ParallelGroup,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    during: Callable[[], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`exchange` with ``during()`` (work that does not need the rows, e.g. the shared
    experts' forward) run while the rows travel: the all-to-all is posted, ``during()`` runs,
    then the rows are waited for. Returns the rows and what ``during()`` returned (None
    without it)."""
    if during is None or group.size == 1:
        return exchange(x, group, out_splits, in_splits), during() if during else None
    pending: list = []
    out = _AllToAll.apply(x, group, list(out_splits), list(in_splits), pending)
    result = during()
    pending[0].wait()
    return out, result


class _GatherRows(torch.autograd.Function):
    """All-gather of uneven row counts over tp; backward reduce-scatters the grads back."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ParallelGroup, sizes: list[int]):
        ctx.group, ctx.sizes = group, sizes
        return all_gather_uneven(x, group, sizes)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        # gloo reduces in place: never into a grad autograd may hand to someone else
        return reduce_scatter_uneven(grad.clone(), ctx.group, ctx.sizes), None, None


class _ScatterRows(torch.autograd.Function):
    """Reduce-scatter of uneven row counts over tp; backward all-gathers the grads."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ParallelGroup, sizes: list[int]):
        ctx.group, ctx.sizes = group, sizes
        return reduce_scatter_uneven(x.clone(), group, sizes)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        return all_gather_uneven(grad, ctx.group, ctx.sizes), None, None


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
    # ep-first order (tp > 1): the rows each tp rank received over ep, gathered over tp
    tp_sizes: list[int] | None = None
    tp_group: ParallelGroup | None = None
    during_result: torch.Tensor | None = None  # what the ``during`` work (shared experts) gave


def dispatch(
    tokens: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    top_k: int,
    group: ParallelGroup,
    during: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, Dispatched]:
    """Send ``tokens`` ``[T, h]``'s assignments ``order`` (sorted by expert, ``counts`` per
    global expert; any dropped ones after ``counts.sum()``) to the ep peers that hold their
    experts; returns the rows of this rank's experts grouped by local expert, and the record for
    :func:`combine`. The host reads the device once: every count, in one copy. ``during``: work
    run while the rows travel (:func:`exchange_during`); its result is in the record."""
    ep = group.size
    if ep == 1:
        local = counts.tolist()  # the one host copy
        order = order[: sum(local)]
        rows = tokens.index_select(0, order // top_k)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        record = Dispatched(order, [rows.shape[0]], [rows.shape[0]], None, local, ends)
        record.during_result = during() if during else None
        return rows, record
    per_peer = counts.shape[0] // ep
    received = torch.empty_like(counts)
    all_to_all(received, counts, group, [per_peer] * ep, [per_peer] * ep)
    host = torch.cat([counts, received]).tolist()  # the one host copy: sent and received
    sent, got = host[: counts.shape[0]], host[counts.shape[0] :]
    in_splits = [sum(sent[p * per_peer : (p + 1) * per_peer]) for p in range(ep)]
    out_splits = [sum(got[p * per_peer : (p + 1) * per_peer]) for p in range(ep)]
    local = [sum(got[p * per_peer + e] for p in range(ep)) for e in range(per_peer)]
    order = order[: sum(in_splits)]
    arrived, result = exchange_during(
        tokens.index_select(0, order // top_k), group, out_splits, in_splits, during
    )
    received = received.view(ep, -1)  # [source, local expert]
    regroup = expert_major(received, total=sum(out_splits))
    ends = torch.cumsum(received.sum(0), 0).to(torch.int32)
    record = Dispatched(order, in_splits, out_splits, regroup, local, ends, during_result=result)
    return arrived.index_select(0, regroup), record


def dispatch_ep_first(
    tokens: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    top_k: int,
    ep: ParallelGroup,
    tp: ParallelGroup,
    during: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, Dispatched, torch.Tensor]:
    """Megatron-LM's order under tensor parallelism: this tp rank's own tokens (its sequence
    shard) go over ep to the ranks holding their experts, then the rows each tp rank received
    are all-gathered over tp (uneven sizes), so every tp rank holds every row of its local
    experts for its tp slice of them. Arguments as :func:`dispatch`, for this rank's tokens.

    Returns the rows grouped by local expert, the record for :func:`combine` (which
    reduce-scatters the experts' partial outputs over tp before the way back) and the
    microbatch's assignments per expert summed over tp (the balancing loss's counts). The host
    reads the device once: the counts sent and received of every tp rank, in one copy.
    ``during``: work run while the rows travel over ep (:func:`exchange_during`)."""
    num_experts, size = counts.shape[0], ep.size
    per_peer = num_experts // size
    received = torch.empty_like(counts)
    all_to_all(received, counts, ep, [per_peer] * size, [per_peer] * size)
    both = all_gather_dim0(torch.cat([counts, received]), tp).view(tp.size, 2, num_experts)
    host = torch.cat([counts, both[:, 1].reshape(-1)]).tolist()  # the one host copy
    sent, got = host[:num_experts], host[num_experts:]
    mine = got[tp.rank * num_experts : (tp.rank + 1) * num_experts]
    in_splits = [sum(sent[p * per_peer : (p + 1) * per_peer]) for p in range(size)]
    out_splits = [sum(mine[p * per_peer : (p + 1) * per_peer]) for p in range(size)]
    tp_sizes = [sum(got[r * num_experts : (r + 1) * num_experts]) for r in range(tp.size)]
    local = [sum(got[s * per_peer + e] for s in range(tp.size * size)) for e in range(per_peer)]
    order = order[: sum(in_splits)]
    arrived, result = exchange_during(
        tokens.index_select(0, order // top_k), ep, out_splits, in_splits, during
    )
    gathered = _GatherRows.apply(arrived, tp, tp_sizes)
    by_source = both[:, 1].reshape(-1, per_peer)  # [tp rank x ep source, local expert]
    regroup = expert_major(by_source, total=sum(tp_sizes))
    ends = torch.cumsum(by_source.sum(0), 0).to(torch.int32)
    record = Dispatched(order, in_splits, out_splits, regroup, local, ends, tp_sizes, tp, result)
    return gathered.index_select(0, regroup), record, both[:, 0].sum(0)


def combine(
    outputs: torch.Tensor,
    record: Dispatched,
    weights: torch.Tensor,
    group: ParallelGroup,
) -> torch.Tensor:
    """The experts' ``outputs`` (rows as :func:`dispatch` returned them) back to their tokens:
    ``sum_slot weight * output``, ``[T, h]`` in the original token order. Dropped slots add 0.
    After :func:`dispatch_ep_first` the outputs are tp-partial: they are summed over tp into
    the rows this rank received, which go back over ep to this rank's own tokens."""
    if record.regroup is not None:
        back = torch.empty_like(record.regroup)
        back[record.regroup] = torch.arange(record.regroup.numel(), device=back.device)
        outputs = outputs.index_select(0, back)
        if record.tp_group is not None:
            outputs = _ScatterRows.apply(outputs, record.tp_group, record.tp_sizes)
        outputs = exchange(outputs, group, record.in_splits, record.out_splits)
    tokens, top_k = weights.shape
    slots = outputs.new_zeros((tokens * top_k, outputs.shape[-1]))
    slots = slots.index_copy(0, record.order, outputs).view(tokens, top_k, -1)
    return (slots * weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1)
