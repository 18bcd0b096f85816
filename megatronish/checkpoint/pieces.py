"""What part of which global tensor this rank holds: rectangles of params and Adam moments.

Both saving and loading walk the same pieces: for each local parameter, the rectangles of its
global tensor that its tensor-parallel shard covers (one per fused block), with the matching
slice of the local tensor. Under ZeRO the Adam moments (and, for stage 3, the params) are sharded
over dp; :func:`full_local_values` materialises the whole local tensors for a bucket at a time.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatronish.data_parallel.buckets import Bucket
from megatronish.data_parallel.zero import ZeroDataParallel
from megatronish.distributed.comm import all_gather_into
from megatronish.optim.sharded_adamw import ShardedAdamW
from megatronish.tensor_parallel.sharding import global_shape, param_info


@dataclass
class Rect:
    """``local.narrow(dim, local_start, length)`` is global rectangle ``offsets``."""

    offsets: list[list[int]]
    dim: int
    local_start: int
    length: int
    first: int = 0  # global index of local row 0 of dim 0 when ``dim`` is another (experts)
    first_copy: bool = True  # False: a replicated head another tp rank saves

    def take(self, local: torch.Tensor) -> torch.Tensor:
        return local.narrow(self.dim, self.local_start, self.length)

    def meet(self, local: list[list[int]]) -> tuple[list[list[int]], int, int] | None:
        """Where local rectangle ``local`` (``[start, length]`` per dim of the local tensor)
        meets this one: ``(global offsets, start, length)``, the part being ``start, length``
        along ``dim`` of ``local``; None when they do not meet."""
        s, n = local[self.dim]
        a, b = max(s, self.local_start), min(s + n, self.local_start + self.length)
        if b <= a:
            return None
        offsets = [list(o) for o in local]  # dims other than ``dim`` are not split ...
        if self.dim != 0:  # ... but for the stack of experts this rank holds
            offsets[0][0] += self.first
        offsets[self.dim] = [self.offsets[self.dim][0] + a - self.local_start, b - a]
        return offsets, a - s, b - a


def param_rects(p: nn.Parameter, tp_rank: int, tp: int) -> list[Rect]:
    """The global rectangles covered by this rank's shard of ``p``."""
    shape = list(global_shape(p, tp))
    shard, experts = param_info(p).shard, param_info(p).experts
    first = 0 if experts is None else experts.first
    if experts is not None:  # this rank's experts of the stack
        shape[0] = p.shape[0]
    if shard is None:
        offsets = [[0, n] for n in shape]
        if offsets:
            offsets[0][0] = first
        return [Rect(offsets, 0, 0, shape[0] if shape else 1)]
    rects, local = [], 0
    for block, (start, n) in enumerate(shard.ranges(tp_rank, tp)):
        offsets = [[0, s] for s in shape]
        offsets[0][0] = first
        offsets[shard.dim] = [start, n]
        copy = shard.first_copy(block, tp_rank, tp)
        rects.append(Rect(offsets, shard.dim, local, n, first, copy))
        local += n
    return rects


def flat_rects(shape: Sequence[int], lo: int, hi: int) -> list[tuple[list[list[int]], int]]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as rectangles (``[start,
    length]`` per dim), each one contiguous run of the elements, with its first flat index: a
    partial first row, the whole rows, a partial last row (recursively for more dims)."""
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [([[lo, hi - lo]] if shape else [], lo)]
    row = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(lo, row), divmod(hi, row)

    def within(r: int, a: int, b: int) -> list[tuple[list[list[int]], int]]:
        return [([[r, 1], *rect], r * row + f) for rect, f in flat_rects(shape[1:], a, b)]

    if r0 == r1:
        return within(r0, c0, c1)
    out = within(r0, c0, row) if c0 else []
    first_whole = r0 + bool(c0)
    if r1 > first_whole:
        out.append(
            ([[first_whole, r1 - first_whole]] + [[0, n] for n in shape[1:]], first_whole * row)
        )
    return out + (within(r1, 0, c1) if c1 else [])


def range_requests(
    p: nn.Parameter, lo: int, hi: int, flat: torch.Tensor, tp_rank: int, tp: int
) -> list[tuple[list[list[int]], torch.Tensor]]:
    """``(global rectangle, destination view)`` pairs whose reads fill ``flat`` with elements
    ``[lo, hi)`` of this rank's (row-major) shard of ``p``: a ZeRO range may cut a parameter
    anywhere, and each piece is still read straight into its place."""
    if p.dim() == 0:
        return [([], flat.view(()))]
    rects = param_rects(p, tp_rank, tp)
    if lo == 0 and hi == p.numel():  # the whole parameter (the common case)
        local = flat.view(p.shape)
        return [(rect.offsets, rect.take(local)) for rect in rects]
    out = []
    for local, first in flat_rects(p.shape, lo, hi):
        numel = math.prod(n for _, n in local)
        view = flat[first - lo : first - lo + numel].view([n for _, n in local])
        for rect in rects:
            hit = rect.meet(local)
            if hit is not None:
                offsets, start, length = hit
                out.append((offsets, view.narrow(rect.dim, start, length)))
    return out


def saved_name(name: str, p: nn.Parameter) -> str:
    """The global name a parameter is stored under (a tied head copy is its embedding)."""
    return param_info(p).tied_to or name


def writes(name: str, p: nn.Parameter, bucket: Bucket, offset: int, tp_rank: int) -> bool:
    """Whether this rank writes ``p``: each unique shard exactly once.

    Tied head copies are never written (the embedding is); tp-replicated params by tp rank 0;
    among dp replicas, the rank whose ZeRO shard holds the param's first element (of the first
    shard group under hybrid sharding).
    """
    if param_info(p).tied_to:
        return False
    if bucket.replicas is not None and bucket.replicas.rank != 0:
        return False
    if param_info(p).shard is None and tp_rank != 0:
        return False
    return min(offset // bucket.shard_size, bucket.dp - 1) == bucket.dp_rank


@torch.no_grad()
def full_local_values(
    zero: ZeroDataParallel,
    optimizer: ShardedAdamW,
    index: int,
    bucket: Bucket,
    into: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full flat fp32 ``(main params, exp_avg, exp_avg_sq)`` of one bucket on this rank
    (collective). Under ZeRO 1-3 they are gathered into ``into`` (three flat buffers of
    ``bucket.numel``), or into new tensors when it is None; ZeRO 0 returns the optimizer's own."""
    dp = bucket.group  # dp x cp, or the expert-data-parallel ranks for experts
    if not zero.zero_stage.shards_optimizer_state:
        return bucket.main_shard, optimizer.exp_avg[index], optimizer.exp_avg_sq[index]
    out = []
    shards = (bucket.main_shard, optimizer.exp_avg[index], optimizer.exp_avg_sq[index])
    for shard, full in zip(shards, into or (None,) * len(shards)):
        if full is None:
            full = torch.empty(bucket.numel, device=bucket.device)
        if shard.device != full.device:  # an offloaded shard: gathered on the device
            shard = shard.to(full.device)
        all_gather_into(full, shard, dp)
        out.append(full)
    return tuple(out)


@contextlib.contextmanager
def copy_threads():
    """Run checkpoint copies on one intra-op thread.

    Saves and loads are hundreds of memory copies; splitting each over threads costs more in
    synchronisation (several ms per copy on a busy machine) than it gains.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
