"""Gradient synchronisation across tp / pp / dp and the exactly-once global grad norm."""

from __future__ import annotations

import torch
from torch import nn

from megatronish.distributed.comm import all_reduce
from megatronish.distributed.topology import Topology


def params_of(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Named parameters of every chunk (global names are unique across chunks)."""
    return [(n, p) for c in chunks for n, p in c.named_parameters()]


def flat_all_reduce(tensors: list[torch.Tensor], group, op: str = "sum") -> None:
    """All-reduce a list of tensors as one flat buffer (one collective)."""
    if group.size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, group, op)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def sync_model_parallel_grads(chunks: list[nn.Module], topo: Topology) -> None:
    """Sum grads that tp or pp ranks compute in pieces.

    - Sequence-parallel params (norm weights, row biases, positions under sp) see one sequence
      shard per tp rank: their grads are summed over tp.
    - A tied embedding has a copy on the first and last stage: both grads are summed over the
      embedding group so the copies stay equal.
    """
    named = params_of(chunks)
    sp = [p.grad for _, p in named if getattr(p, "sequence_parallel", False) and p.grad is not None]
    flat_all_reduce(sp, topo.tp_group)
    if topo.pp > 1:
        tied = [
            p.grad
            for n, p in named
            if p.grad is not None
            and (getattr(p, "tied_to", None) or (n == "embedding.word.weight" and _is_tied(chunks)))
        ]
        flat_all_reduce(tied, topo.embedding_group)


def _is_tied(chunks: list[nn.Module]) -> bool:
    return bool(chunks) and chunks[0].spec.tie_embeddings


def counts_in_norm(name: str, p: nn.Parameter, topo: Topology) -> bool:
    """Whether this rank's copy of ``p`` counts towards the global grad norm.

    Every parameter is counted exactly once: tp-replicated params only on tp rank 0, a tied head
    copy never (its embedding on the first stage counts).
    """
    if getattr(p, "tied_to", None):
        return False
    if getattr(p, "tp_shard", None) is None and topo.coords.tp != 0:
        return False
    return True


def global_grad_norm(chunks: list[nn.Module], topo: Topology, sharded_over_dp: bool = False):
    """The L2 norm of the full model's gradient, as one process would compute it.

    With replicated dp grads the sum runs over the model-parallel group; with grads sharded over
    dp (ZeRO) over the whole world.
    """
    sq = torch.zeros((), dtype=torch.float32, device=topo.device)
    for name, p in params_of(chunks):
        if p.grad is not None and counts_in_norm(name, p, topo):
            sq += p.grad.detach().float().pow(2).sum()
    all_reduce(sq, topo.world_group if sharded_over_dp else topo.mp_group)
    return sq.sqrt()


def clip_grads(chunks: list[nn.Module], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale every grad by ``max_norm / norm`` when the norm exceeds ``max_norm``."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for _, p in params_of(chunks):
        if p.grad is not None:
            p.grad.mul_(coef)
