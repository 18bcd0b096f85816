"""Contiguous flat buffers for parameters and gradients, split into buckets, sharded over dp.

Each bucket owns a flat region of ``numel`` elements (padded to a multiple of dp); every
parameter of the bucket is a view into its param buffer (fp32 or bf16) and accumulates into a
``main_grad`` view of its fp32 grad buffer. dp rank ``r`` owns elements
``[r * numel/dp, (r+1) * numel/dp)`` of every bucket (its ZeRO shard).

Under ZeRO 2/3 buckets follow the parameter units (:mod:`~megatronish.data_parallel.param_units`): a
block's parameters never share a bucket with another block's, so a block is gathered by whole
buckets (zero 3) and the full grads a step holds are those of about one block (zero 2/3).

Experts (parameters holding a stack of experts) never share a bucket with dense parameters:
they are replicated over the expert-data-parallel ranks only, so their buckets are sharded and
reduced over that smaller group (``expert_dp``).

Parameters whose grads need a model-parallel sum first (replicated params fed by sequence
shards, tied embedding copies) go to "late" buckets that are reduced after that sum; all other
buckets are reduced as soon as their grads are final.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from megatronish.data_parallel.param_units import chunk_visits
from megatronish.distributed.comm import ParallelGroup
from megatronish.tensor_parallel.sharding import param_info


@dataclass
class Bucket:
    """A contiguous group of parameters reduced with one collective."""

    params: list[tuple[str, nn.Parameter]]
    offsets: list[int]
    numel: int  # padded to a multiple of dp
    dp: int
    dp_rank: int
    late: bool
    device: torch.device
    expert: bool = False  # holds experts: reduced and sharded over the expert-data-parallel ranks
    group: ParallelGroup | None = None  # the ranks that reduce and shard it (set by its owner)
    replicas: ParallelGroup | None = None  # hybrid sharding: the ranks holding the same shard
    param_flat: torch.Tensor | None = None  # full (zero 0-2) params; None under zero 3
    param_shard: torch.Tensor | None = None  # this rank's slice (a view, or owned under zero 3)
    main_shard: torch.Tensor | None = None  # fp32 values of the owned slice the optimizer updates
    grad_flat: torch.Tensor | None = None  # full grads while accumulating
    grad_shard: torch.Tensor | None = None  # reduced slice (zero >= 1)
    # [lo, hi) ranges of the owned part (relative to its start) where weight decay applies, and
    # where elements count in the global grad norm: contiguous params make them few and free.
    decay_ranges: list[tuple[int, int]] = field(default_factory=list)
    norm_ranges: list[tuple[int, int]] = field(default_factory=list)
    pending: int = 0  # params whose grads are not yet final (this step, or microbatch)
    extra: dict = field(default_factory=dict)

    @property
    def shard_size(self) -> int:
        return self.numel // self.dp

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.dp_rank * self.shard_size, (self.dp_rank + 1) * self.shard_size

    def views(self, flat: torch.Tensor):
        """``(name, param, view of flat)`` for every param of the bucket."""
        for (name, p), off in zip(self.params, self.offsets):
            yield name, p, flat[off : off + p.numel()].view_as(p)

    @torch.no_grad()
    def shard_values(
        self, value_of: Callable[[str, nn.Parameter], torch.Tensor], lo: int, hi: int
    ) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the bucket's flat fp32 values (padding zero), where
        ``value_of(name, p)`` gives a parameter's values: only the parameters that overlap the
        range are drawn, one at a time, so nothing beyond one parameter is ever held whole."""
        out = torch.zeros(hi - lo, device=self.device)
        for (name, p), off in zip(self.params, self.offsets):
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a < b:
                out[a - lo : b - lo] = value_of(name, p).reshape(-1)[a - off : b - off]
        return out

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make every parameter a view of ``flat``; a meta parameter (a deferred build) gets the
        view's tensor in place, so the ``nn.Parameter`` objects the model holds stay the same."""
        for _, p, view in self.views(flat):
            if not p.is_meta:
                p.data = view
                continue
            kept = dict(p.__dict__)  # ParamInfo and any other attribute
            real = nn.Parameter(view.new_empty(0), requires_grad=p.requires_grad)
            real.data = view  # as above: its own version counter, not the (gathered) buffer's
            torch.utils.swap_tensors(p, real)
            p.__dict__.update(kept)

    def ranges(
        self, keep: Callable[[str, nn.Parameter], bool | list[tuple[int, int]]], lo: int, hi: int
    ) -> list[tuple[int, int]]:
        """Merged ``[start, end)`` ranges within ``[lo, hi)`` (relative to ``lo``) covering the
        params where ``keep(name, p)``; ``keep`` may instead return the ``[start, end)``
        element ranges of ``p`` (flat, row-major) to cover."""
        out: list[tuple[int, int]] = []
        for (name, p), off in zip(self.params, self.offsets):
            kept = keep(name, p)
            if isinstance(kept, bool):
                kept = [(0, p.numel())] if kept else []
            for start, end in kept:
                a, b = max(off + start, lo), min(off + end, hi)
                if a >= b:
                    continue
                if out and out[-1][1] == a - lo:
                    out[-1] = (out[-1][0], b - lo)
                else:
                    out.append((a - lo, b - lo))
        return out


FIRST_BUCKET_BYTES = 1 << 20


def needs_model_parallel_sum(p: nn.Parameter, tied: bool) -> bool:
    """Grads summed over tp (sequence-parallel params, replicated heads) or the embedding group
    (tied copies)."""
    info = param_info(p)
    return info.sequence_parallel or info.replicated_heads or tied


def plan_buckets(
    named_params: list[tuple[str, nn.Parameter]],
    bucket_bytes: int,
    dp: int,
    dp_rank: int,
    is_tied: Callable[[str, nn.Parameter], bool],
    device: torch.device,
    first_small: bool = True,
    expert: bool = False,
) -> list[Bucket]:
    """Group params into buckets in reverse order (roughly the order backward finishes them)."""
    groups: dict[bool, list[list[tuple[str, nn.Parameter]]]] = {False: [[]], True: [[]]}
    sizes = {False: 0, True: 0}
    for name, p in reversed(named_params):
        late = needs_model_parallel_sum(p, is_tied(name, p))
        # The first bucket is small (as DDP's) so its reduction starts early in backward.
        first = first_small and len(groups[late]) == 1
        limit = min(bucket_bytes, FIRST_BUCKET_BYTES) if first else bucket_bytes
        if groups[late][-1] and sizes[late] + p.numel() * 4 > limit:
            groups[late].append([])
            sizes[late] = 0
        groups[late][-1].append((name, p))
        sizes[late] += p.numel() * 4
    buckets = []
    for late in (False, True):
        for params in groups[late]:
            if not params:
                continue
            offsets, total = [], 0
            for _, p in params:
                offsets.append(total)
                total += p.numel()
            numel = -(-total // dp) * dp
            buckets.append(Bucket(params, offsets, numel, dp, dp_rank, late, device, expert))
    return buckets


def reduced_over_ranks(bucket: Bucket) -> bool:
    """Whether ``bucket`` is reduced over more than one rank (gradient compression keeps state
    only for those: an expert alone in its group, a group of one, needs none)."""
    return bucket.dp > 1


def is_expert(p: nn.Parameter) -> bool:
    """Whether ``p`` is a stack of experts (replicated over expert data parallelism only)."""
    return param_info(p).experts is not None


def _plan_split(
    named: list[tuple[str, nn.Parameter]],
    bucket_bytes: int,
    dp: int,
    dp_rank: int,
    is_tied: Callable[[str, nn.Parameter], bool],
    device: torch.device,
    expert_dp: tuple[int, int] | None,
    first_small: bool,
) -> list[Bucket]:
    """Dense params' buckets over ``(dp, dp_rank)``, then the experts' over ``expert_dp``."""
    dense = [(n, p) for n, p in named if not is_expert(p)]
    experts = [(n, p) for n, p in named if is_expert(p)]
    out = plan_buckets(dense, bucket_bytes, dp, dp_rank, is_tied, device, first_small)
    if experts:
        edp, edp_rank = expert_dp or (dp, dp_rank)
        out += plan_buckets(
            experts,
            bucket_bytes,
            edp,
            edp_rank,
            is_tied,
            device,
            first_small and not out,
            expert=True,
        )
    return out


def plan_chunk_buckets(
    chunk: nn.Module,
    bucket_bytes: int,
    dp: int,
    dp_rank: int,
    is_tied: Callable[[str, nn.Parameter], bool],
    device: torch.device,
    per_unit: bool,
    expert_dp: tuple[int, int] | None = None,
) -> list[Bucket]:
    """A chunk's buckets; ``per_unit`` (ZeRO 2/3): no bucket spans two units (blocks).
    ``expert_dp``: ``(size, rank)`` of the expert-data-parallel group (default: dp's)."""
    if not per_unit:
        return _plan_split(
            list(chunk.named_parameters()),
            bucket_bytes,
            dp,
            dp_rank,
            is_tied,
            device,
            expert_dp,
            True,
        )
    _, visits = chunk_visits(chunk, 0)
    buckets: list[Bucket] = []
    # Backward order, as plan_buckets; by module, so a unit used at both ends of the chunk (the
    # tied embedding and head) fills one bucket per end rather than one across the backward.
    for visit in reversed(visits):
        if visit.named_params:
            buckets += _plan_split(
                list(visit.named_params),
                bucket_bytes,
                dp,
                dp_rank,
                is_tied,
                device,
                expert_dp,
                not buckets,
            )
    return buckets
