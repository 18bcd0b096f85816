"""Tensor-parallel linear and embedding layers (Megatron style) on ``[s, b, h]`` activations.

With a tp group of one they are plain ``nn.Linear`` / ``nn.Embedding`` computations. Each layer
takes its group and the sequence-parallel flag explicitly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatronish.distributed.comm import ParallelGroup
from megatronish.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from megatronish.tensor_parallel.sharding import TPShard, mark_param


def _empty(
    *shape: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s output dim split over tp.

    The output dim may be a concatenation of ``blocks`` (fused q|k|v or gate|up), each split
    over tp, so rank r computes its slice of every block. Input is replicated (or, with sequence
    parallelism, a sequence shard that is all-gathered first); output stays split.
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
        init_std: float = 0.02,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        blocks = tuple(blocks or (out_features,))
        if sum(blocks) != out_features or any(b % group.size for b in blocks):
            raise ValueError(f"blocks {blocks} must sum to {out_features} and divide by tp")
        self.group, self.sequence_parallel = group, sequence_parallel
        shard = TPShard(dim=0, blocks=blocks)
        self.weight = mark_param(
            _empty(shard.local_size(group.size), in_features, device=device),
            shard=shard,
            std=init_std,
        )
        self.bias = None
        if bias:
            self.bias = mark_param(
                _empty(shard.local_size(group.size), device=device),
                shard=shard,
                init="zeros",
                weight_decay=False,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sp(x, self.group)
        else:
            x = copy_to_tp(x, self.group)
        return F.linear(x, self.weight, self.bias)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(y, self.group)
        else:
            y = reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias


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
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            out = F.embedding(ids, self.weight)
        else:
            local = ids - self.start
            outside = (local < 0) | (local >= self.per_rank)
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.group)
        return reduce_from_tp(out, self.group)
