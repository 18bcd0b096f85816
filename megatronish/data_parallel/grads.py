"""Gradient rules shared by the data-parallel layer and the planner: flat reductions, which
params are tied across stages, which count in the norm."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megatronish.distributed.comm import ParallelGroup, all_reduce
from megatronish.distributed.topology import Topology
from megatronish.tensor_parallel.sharding import param_info


def flat_all_reduce(tensors: list[torch.Tensor], group: ParallelGroup, op: str = "sum") -> None:
    """All-reduce a list of tensors as one flat buffer (one collective)."""
    if group.size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, group, op)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def sum_local_tied_copies(tied: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
    """Sum the word embedding's main grad and its head copy's in place when this rank holds
    both (the V placement puts the first and the last chunk on one stage); returns the main
    grads still to be summed over the embedding group (none then: no other stage holds one)."""
    names = {n for n, _ in tied}
    copies = [p for _, p in tied if param_info(p).tied_to in names]
    if not copies:
        return [p.main_grad for _, p in tied]
    for copy in copies:
        original = next(p for n, p in tied if n == param_info(copy).tied_to)
        original.main_grad.add_(copy.main_grad)
        copy.main_grad.copy_(original.main_grad)
    return []


def tied_rule(tie_embeddings: bool, pp: int) -> Callable[[str, nn.Parameter], bool]:
    """``is_tied(name, p)``: params whose grads are summed over the embedding group: the word
    embedding when a later stage holds the head tied to it, and every head copy (``tied_to``)."""
    tie = tie_embeddings and pp > 1

    def is_tied(name: str, p: nn.Parameter) -> bool:
        return (tie and name == "embedding.word.weight") or bool(param_info(p).tied_to)

    return is_tied


def counts_in_norm(name: str, p: nn.Parameter, topo: Topology) -> bool | list[tuple[int, int]]:
    """Whether this rank's copy of ``p`` counts towards the global grad norm, or which of its
    (flat) elements do.

    Every parameter element is counted exactly once: tp-replicated params only on tp rank 0,
    replicated heads only on their first copy, a tied head copy never (its embedding on the
    first stage counts).
    """
    info = param_info(p)
    if info.tied_to:
        return False
    if info.shard is None and topo.coords.tp != 0:
        return False
    if info.replicated_heads:
        return first_copy_elements(p, topo.coords.tp, topo.tp)
    return True


def _head_blocks(p: nn.Parameter, tp_rank: int, tp: int) -> list[tuple[int, int, int, bool]]:
    """``(block, local start, length, first copy)`` along the shard's dim of each block of
    ``p``'s (dim-0) shard on ``tp_rank``."""
    shard = param_info(p).shard
    assert shard is not None and shard.dim == 0, "replicated heads are split along dim 0"
    out, local = [], 0
    for i, (_, n) in enumerate(shard.ranges(tp_rank, tp)):
        out.append((i, local, n, shard.first_copy(i, tp_rank, tp)))
        local += n
    return out


def first_copy_elements(p: nn.Parameter, tp_rank: int, tp: int) -> list[tuple[int, int]]:
    """Flat ``[start, end)`` element ranges of ``p`` that this rank holds the first copy of."""
    row = math.prod(p.shape[1:])
    return [
        (start * row, (start + n) * row)
        for _, start, n, first in _head_blocks(p, tp_rank, tp)
        if first
    ]


def sum_partial_grads_over_tp(params: list[nn.Parameter], group: ParallelGroup) -> None:
    """Sum the partial main grads over tp in one all-reduce: replicated params fed by sequence
    shards or per-head norms (whole), and replicated heads (each rank's copy placed at its
    head in a zero block the size of the whole, so copies of one head add up and different
    heads stay apart)."""
    whole = [p.main_grad for p in params if param_info(p).sequence_parallel]
    blocks: list[torch.Tensor] = []
    placed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (local rows, their rows in a block)
    for p in params:
        if not param_info(p).replicated_heads:
            continue
        shard = param_info(p).shard
        for i, local_start, n, _ in _head_blocks(p, group.rank, group.size):
            if shard.parts(i, group.size) == group.size:  # split, not replicated
                continue
            local = p.main_grad.narrow(0, local_start, n)
            block = local.new_zeros(shard.blocks[i], *local.shape[1:])
            at = block.narrow(0, shard.piece(i, group.rank, group.size) * n, n)
            at.copy_(local)
            blocks.append(block)
            placed.append((local, at))
    flat_all_reduce(whole + blocks, group)
    for local, at in placed:
        local.copy_(at)
