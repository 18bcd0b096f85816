"""Autograd functions that move activations between tensor-parallel regions.

Each forward is paired with its dual in backward (Megatron's mappings):

==========================  =====================  =====================
function                    forward                backward
==========================  =====================  =====================
copy_to_tp                  identity               all-reduce
reduce_from_tp              all-reduce             identity
scatter_to_tp (last dim)    keep own slice         all-gather
gather_from_tp (last dim)   all-gather             keep own slice
scatter_to_sp (dim 0)       keep own slice         all-gather
gather_from_sp (dim 0)      all-gather             reduce-scatter
reduce_scatter_to_sp        reduce-scatter         all-gather
==========================  =====================  =====================

Activations are ``[s, b, h]``; the sequence-parallel functions act on dim 0 (the sequence).
Every function takes its group explicitly and is the identity for a group of one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatronish.distributed.comm import (
    ParallelGroup,
    all_gather_dim0,
    all_reduce,
    reduce_scatter_dim0,
)

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


def in_backward() -> bool:
    """True inside autograd's backward (a recomputed forward runs there)."""
    return torch._C._current_graph_task_id() != -1


def _split_last(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    size = x.shape[-1] // group.size
    return x.narrow(-1, group.rank * size, size).contiguous()


def _gather_last(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    stacked = all_gather_dim0(x.unsqueeze(0), group)
    return torch.cat(stacked.unbind(0), dim=-1)


def _split_first(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    size = x.shape[0] // group.size
    return x.narrow(0, group.rank * size, size).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(g.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(g, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(g, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_dim0(g, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return reduce_scatter_dim0(g, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_dim0(g, ctx.group), None


def _apply(
    fn: type[torch.autograd.Function], x: torch.Tensor, group: ParallelGroup
) -> torch.Tensor:
    return x if group.size == 1 else fn.apply(x, group)


def copy_to_tp(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the grad backward."""
    return _apply(_CopyToTP, x, group)


def reduce_from_tp(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Leave a tensor-parallel region: all-reduce forward, identity backward."""
    return _apply(_ReduceFromTP, x, group)


def scatter_to_tp(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Keep this rank's slice of the last dim; all-gather the grad."""
    return _apply(_ScatterToTP, x, group)


def gather_from_tp(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """All-gather the last dim; keep this rank's slice of the grad."""
    return _apply(_GatherFromTP, x, group)


def scatter_to_sp(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Keep this rank's sequence shard (dim 0); all-gather the grad."""
    return _apply(_ScatterToSP, x, group)


def gather_from_sp(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """All-gather sequence shards (dim 0); reduce-scatter the grad."""
    return _apply(_GatherFromSP, x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence shard; all-gather the grad."""
    return _apply(_ReduceScatterToSP, x, group)
