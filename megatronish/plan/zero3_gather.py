"""ZeRO 3's gathered parameters: how many are whole at once, and how often they are gathered.

This replays :class:`~megatronish.data_parallel.param_gather.ParamGatherer`'s rules on a chunk's
units (pure arithmetic on their bucket sizes): in forward a unit is gathered with the next one
prefetched and freed after its last module; the loss's unit stays until its backward; in
backward a unit is gathered with the previous one prefetched, a checkpointed segment's recompute
gathers all of its units, and a unit is freed once its grads are in (after its first module in
forward order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.data_parallel.buckets import plan_chunk_buckets
from megatronish.data_parallel.param_units import chunk_visits
from megatronish.model.recompute import recompute_segments
from megatronish.plan.layout import Layout


@dataclass(frozen=True)
class ChunkUnits:
    """One chunk's units as ZeRO 3 gathers them."""

    buckets: tuple[tuple[int, ...], ...]  # padded numel of each unit's buckets, units in order
    visits: tuple[int, ...]  # the unit of each module visit, in forward order
    loss_unit: int | None  # the unit that holds the loss (last chunk only)
    segments: tuple[tuple[int, int, bool], ...]  # recompute runs over visits (start, end, ckpt)
    experts: tuple[tuple[bool, ...], ...] = ()  # which of each unit's buckets hold experts

    @property
    def sizes(self) -> list[int]:
        return [sum(b) for b in self.buckets]


def expert_dp(layout: Layout) -> dict:
    """The buckets' ``expert_dp`` argument: experts sharded over ``dp * cp / ep`` ranks (the
    default, dp x cp, without expert parallelism)."""
    return {"expert_dp": (layout.edp, 0)} if layout.ep > 1 else {}


def chunk_units(chunk, layout: Layout, is_tied) -> ChunkUnits:
    """``chunk``'s units (a meta-device GPT chunk) with the buckets the trainer would plan."""
    units, visits = chunk_visits(chunk, 0)
    buckets = plan_chunk_buckets(
        chunk,
        int(layout.bucket_size_mb * 2**20),
        layout.dp_cp,
        0,
        is_tied,
        torch.device("meta"),
        per_unit=True,
        **expert_dp(layout),
    )
    unit_of = {id(p): k for k, u in enumerate(units) for p in u.params}
    per_unit: list[list[int]] = [[] for _ in units]
    expert: list[list[bool]] = [[] for _ in units]
    for b in buckets:
        per_unit[unit_of[id(b.params[0][1])]].append(b.numel)
        expert[unit_of[id(b.params[0][1])]].append(b.expert)
    index = {id(u): k for k, u in enumerate(units)}
    loss = [k for k, u in enumerate(units) if u.holds_loss]
    first_block = 1 if getattr(chunk, "embedding", None) is not None else 0
    n_blocks = len(getattr(chunk, "layers", ()))
    runs = recompute_segments(
        n_blocks, layout.recompute, layout.recompute_method, layout.recompute_num_layers
    )
    return ChunkUnits(
        buckets=tuple(tuple(b) for b in per_unit),
        visits=tuple(index[id(v.unit)] for v in visits),
        loss_unit=loss[0] if loss else None,
        segments=tuple((first_block + a, first_block + b, c) for a, b, c in runs),
        experts=tuple(tuple(e) for e in expert) if any(map(any, expert)) else (),
    )


def peak_gathered(cu: ChunkUnits) -> int:
    """Most elements of ``cu``'s full params held at once during one forward and backward."""
    sizes, visits = cu.sizes, cu.visits
    first = {u: visits.index(u) for u in set(visits)}
    last = {u: len(visits) - 1 - visits[::-1].index(u) for u in set(visits)}
    held: set[int] = set()
    peak = 0

    def add(*units: int | None) -> None:
        nonlocal peak
        held.update(u for u in units if u is not None)
        peak = max(peak, sum(sizes[u] for u in held))

    n = len(visits)
    for i, u in enumerate(visits):  # forward, the next unit prefetched
        add(u, visits[i + 1] if i + 1 < n else None)
        if last[u] == i and u != cu.loss_unit:
            held.discard(u)
    held &= {cu.loss_unit}
    ends = {end - 1: (start, end) for start, end, ckpt in cu.segments if ckpt}
    for i in reversed(range(n)):  # backward, the previous unit prefetched
        add(visits[i], visits[i - 1] if i > 0 else None)
        if i in ends:  # the segment's recompute
            start, end = ends[i]
            add(*visits[start:end])
        if first[visits[i]] == i:
            held.discard(visits[i])
    return peak


def rank_peak_gathered(chunks: list[ChunkUnits], keep_gathered: bool = False) -> int:
    """Peak gathered elements of a rank's chunks: one chunk computes at a time, the loss's
    unit may stay gathered meanwhile; everything under ``keep_gathered``."""
    if keep_gathered:
        return sum(sum(c.sizes) for c in chunks)
    held_loss = sum(c.sizes[c.loss_unit] for c in chunks if c.loss_unit is not None)
    return max(peak_gathered(c) + (held_loss if c.loss_unit is None else 0) for c in chunks)


def gathers_per_microbatch(cu: ChunkUnits, experts: bool | None = None) -> tuple[int, int]:
    """``(all-gather calls, elements)`` of one microbatch's forward and backward: every unit
    once each way, the loss's unit once (it stays gathered in between). ``experts``: only the
    expert buckets (True) or only the others (False); None: all."""
    calls = numel = 0
    for k, buckets in enumerate(cu.buckets):
        times = 1 if k == cu.loss_unit else 2
        flags = cu.experts[k] if cu.experts else (False,) * len(buckets)
        mine = [n for n, e in zip(buckets, flags) if experts is None or e == experts]
        calls += times * len(mine)
        numel += times * sum(mine)
    return calls, numel
