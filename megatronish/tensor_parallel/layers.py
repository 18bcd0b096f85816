"""Tensor-parallel linear and embedding layers (Megatron style) on ``[s, b, h]`` activations.

With a tp group of one they are plain ``nn.Linear`` / ``nn.Embedding`` computations. Each layer
takes its group and the sequence-parallel flag explicitly.

Split backward (zero-bubble schedules): each layer hands its weight grads to its
``weight_grad_store`` (:mod:`megatronish.tensor_parallel.weight_grad`), which computes them at
once or, while deferring, in the schedule's W; the input grad and every tp collective of the
backward stay in B. A sequence-parallel column-parallel linear keeps its all-gathered input (the
one the linear saves for backward today) for W rather than gathering it again there: a gather in
W would be communication exposed inside the bubble-filling work and one more tp collective whose
order every tp rank must match, while 1F1B already keeps the gathered input until the backward;
W only extends its life from B to W (the planner counts it). The row-parallel bias is added
after the reduction; its grad is W work too. The embedding's whole backward is W (the ids take
no grad; the reduction's backward, a tp collective, stays in B).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megatronish.distributed.comm import ParallelGroup
from megatronish.tensor_parallel.fp8 import fp8_linear
from megatronish.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from megatronish.tensor_parallel.sharding import TPShard, mark_param
from megatronish.tensor_parallel.split_linear import add_bias, linear
from megatronish.tensor_parallel.weight_grad import (
    GradPairs,
    WeightGradStore,
    grad_of,
    weight_grads,
)

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


def _empty(
    *shape: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s output dim split over tp.

    The output dim may be a concatenation of ``blocks`` (fused q|k|v or gate|up), each split
    over tp, so rank r computes its slice of every block; a block of ``block_heads`` fewer than
    tp has each head replicated on tp / heads ranks (see :class:`TPShard`). Input is replicated
    (or, with sequence parallelism, a sequence shard that is all-gathered first); output stays
    split.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ParallelGroup,
        *,
        bias: bool = False,
        sequence_parallel: bool = False,
        blocks: tuple[int, ...] | None = None,
        block_heads: tuple[int, ...] | None = None,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        blocks = tuple(blocks or (out_features,))
        shard = TPShard(dim=0, blocks=blocks, heads=tuple(block_heads or ()))
        tp = group.size
        parts = [shard.parts(i, tp) for i in range(len(blocks))]
        if sum(blocks) != out_features or any(b % n or tp % n for b, n in zip(blocks, parts)):
            raise ValueError(
                f"blocks {blocks} (heads {block_heads}) must sum to {out_features} and each "
                f"split over tp={tp}, or over heads that divide tp"
            )
        self.group, self.sequence_parallel = group, sequence_parallel
        replicated = shard.replicates(tp)
        self.weight = mark_param(
            _empty(shard.local_size(tp), in_features, device=device),
            shard=shard,
            std=init_std,
            replicated_heads=replicated,
        )
        self.bias = None
        if bias:
            self.bias = mark_param(
                _empty(shard.local_size(tp), device=device),
                shard=shard,
                init="zeros",
                weight_decay=False,
                replicated_heads=replicated,
            )
        self.weight_grad_store: WeightGradStore | None = None
        self.fp8: str | None = None  # trainer.fp8's recipe where this linear runs in fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sp(x, self.group)
        else:
            x = copy_to_tp(x, self.group)
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, self.bias, self.fp8)
        return linear(x, self.weight, self.bias, self.weight_grad_store)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s input dim split over tp; the input is already split.

    Partial outputs are summed over tp (all-reduce), or with sequence parallelism
    reduce-scattered to sequence shards. The bias is added after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ParallelGroup,
        *,
        bias: bool = False,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if in_features % group.size:
            raise ValueError(f"in_features {in_features} is not divisible by tp={group.size}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = mark_param(
            _empty(out_features, in_features // group.size, device=device),
            shard=TPShard(dim=1, blocks=(in_features,)),
            std=init_std,
        )
        self.bias = None
        if bias:
            self.bias = mark_param(
                _empty(out_features, device=device),
                init="zeros",
                sequence_parallel=sequence_parallel and group.size > 1,
                weight_decay=False,
            )
        self.weight_grad_store: WeightGradStore | None = None
        self.fp8: str | None = None  # trainer.fp8's recipe where this linear runs in fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            y = fp8_linear(x, self.weight, None, self.fp8)
        else:
            y = linear(x, self.weight, store=self.weight_grad_store)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(y, self.group)
        else:
            y = reduce_from_tp(y, self.group)
        return y if self.bias is None else add_bias(y, self.bias, self.weight_grad_store)


class _Lookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` with the rows of ``outside`` ids zeroed; its backward (the
    weight's grad: the ids take none) goes through the store."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        ids: torch.Tensor,
        weight: torch.Tensor,
        outside: torch.Tensor | None,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        out = F.embedding(ids, weight)
        if outside is not None:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        ctx.save_for_backward(ids, outside)
        ctx.weight, ctx.store = weight, store
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[None, torch.Tensor | None, None, None]:
        ids, outside = ctx.saved_tensors
        weight = ctx.weight

        def job() -> GradPairs:  # the ops of masked_fill's and embedding's backward
            g = grad if outside is None else grad.masked_fill(outside.unsqueeze(-1), 0)
            rows = weight.shape[0]
            return [(weight, torch.ops.aten.embedding_dense_backward(g, ids, rows, -1, False))]

        return None, grad_of(weight_grads(ctx.store, job), weight), None, None


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split over tp.

    Takes ids ``[s, b]`` and returns ``[s, b, h]`` (full sum over tp, or this rank's sequence
    shard with sequence parallelism). Ids outside this rank's range contribute zeros.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: ParallelGroup,
        *,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if num_embeddings % group.size:
            raise ValueError(f"vocab {num_embeddings} is not divisible by tp={group.size}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.per_rank = num_embeddings // group.size
        self.start = group.rank * self.per_rank
        self.weight = mark_param(
            _empty(self.per_rank, embedding_dim, device=device),
            shard=TPShard(dim=0, blocks=(num_embeddings,)),
            std=init_std,
            vocab=True,
        )
        self.weight_grad_store: WeightGradStore | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local, outside = ids, None
        if self.group.size > 1:
            local = ids - self.start
            outside = (local < 0) | (local >= self.per_rank)
            local = local.masked_fill(outside, 0)
        store = self.weight_grad_store
        if store is not None and torch.is_grad_enabled() and self.weight.requires_grad:
            out = _Lookup.apply(local, self.weight, outside, store)
        else:
            out = F.embedding(local, self.weight)
            if outside is not None:
                out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.group)
        return reduce_from_tp(out, self.group)
