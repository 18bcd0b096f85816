"""Gradient rules shared by the data-parallel layer and the planner: flat reductions, which
params are tied across stages, which count in the norm."""

from __future__ import annotations

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


def counts_in_norm(name: str, p: nn.Parameter, topo: Topology) -> bool:
    """Whether this rank's copy of ``p`` counts towards the global grad norm.

    Every parameter is counted exactly once: tp-replicated params only on tp rank 0, a tied head
    copy never (its embedding on the first stage counts).
    """
    if param_info(p).tied_to:
        return False
    if param_info(p).shard is None and topo.coords.tp != 0:
        return False
    return True
