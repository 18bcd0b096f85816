"""The global L2 norm of the grads, every parameter element counted exactly once across tp, pp
and dp: each rank sums the squares of its owned grads' elements that count
(:func:`~megatronish.data_parallel.grads.counts_in_norm`, set per bucket as ``norm_ranges``) and
one all-reduce adds the ranks' sums."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatronish.distributed.comm import ParallelGroup, all_reduce
from megatronish.distributed.timers import Timers


def global_grad_norm(
    owned: Iterable[tuple[torch.Tensor, list[tuple[int, int]]]],
    group: ParallelGroup,
    device: torch.device,
    timers: Timers,
    local_fault: torch.Tensor | None = None,
) -> torch.Tensor:
    """The norm of the elements ``grad[lo:hi]`` for ``(grad, ranges)`` in ``owned`` and every
    ``(lo, hi)`` in ``ranges``, summed over ``group``; it stays on the device.

    ``local_fault``: this rank saw a non-finite value elsewhere (a 0-dim bool tensor on the
    device); the norm then comes out nan on every rank of ``group``.
    """
    sq = torch.zeros((), device=device)
    if local_fault is not None:
        sq = torch.where(local_fault, float("nan"), sq)
    for grad, ranges in owned:
        for lo, hi in ranges:
            sq += grad[lo:hi].square().sum()  # torch's cascade sum keeps round-off small
    with timers.region(None, "grad norm all-reduce"):
        all_reduce(sq, group)
    return sq.sqrt()
