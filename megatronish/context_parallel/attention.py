"""Causal attention over a sequence split across the cp group: K/V all-gathered, Q local.

Each rank keeps the queries of its two chunks (see :mod:`~megatronish.context_parallel.split`)
and all-gathers keys and values, at the kv-head count (GQA stays grouped on the wire), once per
layer; backward reduce-scatters their gradients. A query chunk at chunk index ``j`` attends to
keys ``[0, (j+1)c)`` with a lower-right causal mask, so no rank computes scores that the mask
would discard beyond its own diagonal blocks, and the two chunks' work sums to the same on every
rank. docs/parallelism.md compares this with ring attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatronish.context_parallel.attention_kernel import expand_kv_heads, kernel_for, sdpa
from megatronish.context_parallel.split import (
    chunk_ids,
    local_positions,
    natural_order,
    rank_major_order,
    split_sequence,
)
from megatronish.distributed.comm import (
    ParallelGroup,
    all_gather_dim0,
    reduce_scatter_dim0,
    single_group,
)
from megatronish.distributed.p2p import BatchedP2P, P2PCommunicator

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


@dataclass
class CPContext:
    """The cp group and the full sequence length; which positions this rank holds."""

    group: ParallelGroup = field(default_factory=lambda: single_group("cp"))
    seq_length: int = 0
    # parallel.cp_comm_type: all_gather (K/V gathered, local queries), a2a (heads exchanged
    # for sequence, :mod:`~megatronish.context_parallel.head_exchange`), ring (K/V blocks
    # passed around the group, :mod:`~megatronish.context_parallel.ring`) or a2a_ring (heads
    # exchanged inside ``a2a_group``, then a ring over ``ring_group``)
    comm_type: str = "all_gather"
    a2a_group: ParallelGroup | None = None  # a2a_ring: this rank's all-to-all group
    ring_group: ParallelGroup | None = None  # a2a_ring: the ring across the a2a groups
    # What posts ring attention's p2p groups on ``group`` (None: BatchedP2P; tests pass a
    # recording or NCCL-strict one)
    p2p: Callable[[ParallelGroup], P2PCommunicator] | None = None
    _positions: dict = field(default_factory=dict, repr=False)
    _masks: dict = field(default_factory=dict, repr=False)
    _communicator: P2PCommunicator | None = field(default=None, repr=False)
    _core: CPContext | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def heads_group(self) -> ParallelGroup | None:
        """The group that exchanges heads for sequence around attention: the cp group under
        a2a, this rank's a2a group under a2a_ring; None when heads stay put."""
        if self.size == 1 or self.comm_type not in ("a2a", "a2a_ring"):
            return None
        if self.comm_type == "a2a":
            return self.group
        if self.a2a_group is None or self.ring_group is None:
            raise ValueError("cp_comm_type=a2a_ring needs the Topology's cp_a2a and cp_ring groups")
        return self.a2a_group

    def core_context(self) -> CPContext:
        """The cp context attention itself runs in: one process's after a2a's exchange (it holds
        the whole sequence), after a2a_ring's the ring over ``ring_group`` (a member of a2a
        group ``g`` then holds, in order, the 2a chunks of its members, which are chunks ``g``
        and ``2 cp / a - 1 - g`` of the load-balanced split over ``cp / a`` ranks), else this
        one."""
        if self.heads_group is None:
            return self
        if self._core is None:  # one for every layer: the ring's posts share one communicator
            self._core = (
                CPContext(seq_length=self.seq_length)
                if self.comm_type == "a2a"
                else CPContext(
                    group=self.ring_group,
                    seq_length=self.seq_length,
                    comm_type="ring",
                    p2p=self.p2p,
                )
            )
        return self._core

    def communicator(self) -> P2PCommunicator:
        """The communicator of ring attention's groups, made once."""
        if self._communicator is None:
            self._communicator = (self.p2p or BatchedP2P)(self.group)
        return self._communicator

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens (``[s / cp]``, int64)."""
        key = str(device)
        if key not in self._positions:
            pos = local_positions(self.seq_length, self.size, self.group.rank)
            self._positions[key] = torch.tensor(pos, dtype=torch.long, device=device)
        return self._positions[key]

    def mask(self, queries: int, keys: int, device: torch.device, dtype: torch.dtype):
        """:func:`causal_mask`, built once per shape, device and dtype: every layer and
        microbatch shares it (on CPU a tensor that SDPA keeps for backward)."""
        key = (queries, keys, str(device), dtype)
        if key not in self._masks:
            self._masks[key] = causal_mask(queries, keys, device, dtype)
        return self._masks[key]

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's chunks of the whole-sequence tensor ``x`` along ``dim``."""
        return split_sequence(x, dim, self.size, self.group.rank)


@functools.lru_cache(maxsize=64)
def chunk_index(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``order`` as an index tensor on ``device``, built once: a tensor made from a Python list
    on a GPU is a host-to-device copy the host waits for, and every layer would make one in
    forward and in backward."""
    return torch.tensor(order, device=device)


def reorder_chunks(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Permute the ``len(order)`` equal chunks of dim 0: chunk ``i`` of the result is chunk
    ``order[i]`` of ``x``."""
    chunks = x.view(len(order), x.shape[0] // len(order), *x.shape[1:])
    return chunks.index_select(0, chunk_index(tuple(order), x.device)).reshape(x.shape)


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather every rank's ``[s/cp, ...]`` into the whole ``[s, ...]`` in sequence
    order. Backward: the gradient's chunks back to rank order, reduce-scattered (every rank's
    queries contribute to every key)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
        ctx.group = group
        return reorder_chunks(all_gather_dim0(x, group), natural_order(group.size))

    @staticmethod
    def backward(ctx: FunctionCtx, g: torch.Tensor):
        g = reorder_chunks(g.contiguous(), rank_major_order(ctx.group.size))
        return reduce_scatter_dim0(g, ctx.group), None


def gather_sequence(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """The whole sequence of ``x`` (``[s/cp, ...]`` on each rank, dim 0 the sequence)."""
    if cp.size == 1:
        return x
    return _GatherSequence.apply(x, cp.group)


def causal_mask(
    queries: int, keys: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor | object:
    """Lower-right causal mask: query ``i`` of the last ``queries`` sees keys ``<= keys - queries
    + i``. On CPU an additive ``dtype`` mask (0 or -inf): SDPA's flash kernel would turn a
    boolean one into that on every call and keep the copy for backward. On CUDA torch's
    ``causal_lower_right`` bias, which its fused kernels apply without a mask tensor."""
    if device.type == "cuda":
        # Imported here: the module loads torch._dynamo (800 modules, a second of start-up).
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(queries, keys)
    visible = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
    mask = torch.zeros(queries, keys, dtype=dtype, device=device)
    return mask.masked_fill_(~visible, float("-inf"))


def cp_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPContext, dropout_p: float
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for local queries ``q`` ``[b, heads, s/cp, d]`` against the
    whole sequence's ``k`` and ``v`` ``[b, kv_heads, s, d]``; output ``[b, heads, s/cp, d]``.
    The kernel and the K/V layout follow :func:`~.attention_kernel.kernel_for`; K/V that need
    expanding to the query heads are expanded once, for both chunks."""
    c = q.shape[2] // 2
    kind = "lower_right" if q.is_cuda else "tensor"  # causal_mask's form on each device
    slots = list(enumerate(chunk_ids(cp.size, cp.group.rank)))
    heads, first = q.shape[1], (slots[0][1] + 1) * c  # the first chunk's keys
    if k.shape[1] != heads:  # grouped-query attention: one decision, one copy for both chunks
        mask = cp.mask(c, first, q.device, q.dtype)
        kernel = kernel_for(q[:, :, :c], k[:, :, :first], v[:, :, :first], kind, mask, dropout_p)
        if kernel.expand_kv:
            k, v = expand_kv_heads(k, heads), expand_kv_heads(v, heads)
    outs = []
    for slot, j in slots:
        keys = (j + 1) * c
        outs.append(
            sdpa(
                q[:, :, slot * c : (slot + 1) * c],
                k[:, :, :keys],
                v[:, :, :keys],
                kind,
                attn_mask=cp.mask(c, keys, q.device, q.dtype),
                dropout_p=dropout_p,
            )
        )
    return torch.cat(outs, dim=2)
