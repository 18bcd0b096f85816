"""All-to-all context parallelism (``parallel.cp_comm_type=a2a``, DeepSpeed-Ulysses): heads
exchanged for sequence.

Before attention each cp rank holds its two chunks of the sequence (see
:mod:`~megatronish.context_parallel.split`) for every head; one all-to-all gives it the whole
sequence, in order, for ``1 / cp`` of the heads, which it attends over like one process (causal,
or within documents). A second all-to-all brings the output back to the rank's chunks for every
head. Backward runs each exchange the other way. Query and kv heads are exchanged together,
group ``g`` of ``cp`` holding query heads ``[g a/cp, (g+1) a/cp)`` and the kv heads they use
(``[g kv/cp, (g+1) kv/cp)``), so grouped-query attention stays grouped and needs no copy.

Under ``parallel.cp_comm_type=a2a_ring`` the same exchange runs inside each group of
``cp_a2a_size`` consecutive cp ranks: member ``i`` of group ``g`` holds chunks ``g a + i`` and
``2cp - 1 - g a - i``, so the group's ``2a`` chunks in order are chunks ``g`` and
``2 cp/a - 1 - g`` of the sequence cut for ``cp / a`` ranks, for ``1 / a`` of the heads: what a
rank of a ring over ``cp / a`` ranks holds (:meth:`~.attention.CPContext.core_context`).

Volume per layer and microbatch (CommStats counts each tensor sent, the rank's own part
included): ``s/cp b (a + 2 kv) d`` before and ``s/cp b a d`` after attention, and the same in
backward; nothing holds the whole sequence's K/V for every head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatronish.context_parallel.attention import reorder_chunks
from megatronish.context_parallel.split import natural_order, rank_major_order
from megatronish.distributed.comm import ParallelGroup, all_to_all

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


def _sequence_to_heads(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """``[s/cp, b, cp n, d]`` (this rank's chunks, every head group) -> ``[s, b, n, d]`` (the
    whole sequence in order, this rank's head group)."""
    cp = group.size
    s_local, b, heads, d = x.shape
    send = x.reshape(s_local, b, cp, heads // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)  # [source rank, s/cp, b, n, d]: rank-major chunks
    all_to_all(received, send, group, [1] * cp, [1] * cp)
    whole = received.view(cp * s_local, b, heads // cp, d)
    return reorder_chunks(whole, natural_order(cp))


def _heads_to_sequence(y: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_heads`: ``[s, b, n, d]`` -> ``[s/cp, b, cp n, d]``."""
    cp = group.size
    s, b, n, d = y.shape
    send = reorder_chunks(y.contiguous(), rank_major_order(cp)).view(cp, s // cp, b, n, d)
    received = torch.empty_like(send)  # [head group, s/cp, b, n, d]
    all_to_all(received, send, group, [1] * cp, [1] * cp)
    return received.permute(1, 2, 0, 3, 4).reshape(s // cp, b, cp * n, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, g: torch.Tensor):
        return _heads_to_sequence(g, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, y: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_sequence(y, group)

    @staticmethod
    def backward(ctx: FunctionCtx, g: torch.Tensor):
        return _sequence_to_heads(g.contiguous(), ctx.group), None


def qkv_to_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ParallelGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's chunks of ``q`` ``[s/cp, b, a, d]`` and ``k``, ``v`` ``[s/cp, b, kv, d]`` ->
    the whole sequence of this rank's ``a / cp`` query and ``kv / cp`` kv heads, in one
    all-to-all."""
    cp, s_local, b, d = group.size, q.shape[0], q.shape[1], q.shape[3]
    heads = [t.shape[2] // cp for t in (q, k, v)]
    grouped = torch.cat([t.reshape(s_local, b, cp, n, d) for t, n in zip((q, k, v), heads)], dim=3)
    whole = _SequenceToHeads.apply(grouped.view(s_local, b, cp * sum(heads), d), group)
    return whole.split(heads, dim=2)


def heads_to_sequence(out: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Attention output of this rank's heads over the whole sequence ``[s, b, a/cp, d]`` ->
    this rank's chunks for every head ``[s/cp, b, a, d]``."""
    return _HeadsToSequence.apply(out, group)
