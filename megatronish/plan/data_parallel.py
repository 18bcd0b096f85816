"""ZeRO and data parallelism (``parallel.zero_stage``, dp x cp) in the plan: the states a rank
holds, ZeRO 3's gathered params, the dp collectives, and how much of them a step waits for.

- **States**: the rank's chunks (:func:`~megatronish.plan.rank_model.meta_chunks`) are grouped
  into the same buckets as :class:`~megatronish.data_parallel.zero.ZeroDataParallel` would, so
  padding, tied copies and replicated norms are counted exactly as the trainer allocates them.
  What each stage shards is the trainer's table (:mod:`~megatronish.data_parallel.stages`).
  Grads and both Adam moments are fp32; under bf16 the model's params are bf16 and the optimizer
  keeps fp32 main params of its shard. ZeRO shards over dp x cp (hybrid sharding: over cp x
  ``zero_shard_size`` of them); expert buckets over the expert-data-parallel ranks (``dp * cp /
  ep``, :mod:`~megatronish.plan.moe`). Optimizer offload moves the fp32 main params and the
  moments to the host (``host``, with the grads copied down and a staging copy of the params:
  pinned slabs, one per kind, each rounded up to a power of two as torch pins it), out of the
  device's total.
- **ZeRO 3's gathered params** replay :class:`~megatronish.data_parallel.param_gather.
  ParamGatherer`'s rules on a chunk's units (pure arithmetic on their bucket sizes): in forward a
  unit is gathered with the next one prefetched and freed after its last module; the loss's unit
  stays until its backward; in backward a unit is gathered with the previous one prefetched, a
  checkpointed segment's recompute gathers all of its units, and a unit is freed once its grads
  are in (after its first module in forward order).
- **Communication** (:func:`dp_volume`, CommStats' bytes): grad reductions and param gathers,
  one call per bucket, over dp (``dp_cp`` under context parallelism; expert grads over ``edp``;
  under hybrid sharding ``zero_shard``, then one all-reduce of each shard over ``zero_replica``).
- **Step time** (:func:`exposed_dp_time`): ZeRO 3 prefetches, so only the first unit of each
  forward and backward waits: exposed = ``max(gathers / units per chunk, gathers - compute)``.
  ZeRO 1/2's gather of the updated params runs during the next step's first forward: exposed =
  ``max(one bucket, gather - that forward)``. The grad reduction starts bucket by bucket during
  the backward that fills it and hides behind it, except the last bucket: ZeRO 0/1 reduce in the
  last microbatch's backward, exposed = ``max(one bucket, all reductions - that backward)``;
  ZeRO 2/3 in every backward, each waiting for its last bucket, exposed = ``max(m v buckets,
  all reductions - all backwards)``. Hybrid sharding's all-reduce of each reduced shard over the
  replicas starts when the shard's last reduction of the step is done and hides behind the last
  microbatch's backward as ZeRO 0/1's reductions do (on another link: the shard group is inside
  a node). Optimizer offload (:func:`offload_time`) adds the host's update and the copies the
  backward and the next forward do not hide. On shared cores nothing overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.data_parallel.buckets import Bucket, plan_chunk_buckets
from megatronish.data_parallel.grad_reduce import MAX_IN_FLIGHT
from megatronish.data_parallel.offload import slab_dtypes
from megatronish.data_parallel.param_units import chunk_visits
from megatronish.data_parallel.pinned_memory import pinned_block_bytes
from megatronish.data_parallel.stages import ZERO_STAGES, ZeroStage
from megatronish.model.gpt import GPTChunk
from megatronish.plan import grad_compression
from megatronish.plan.hardware import Hardware, add_volumes
from megatronish.plan.layout import Layout
from megatronish.plan.moe import expert_dp, expert_group
from megatronish.plan.pipeline import chunk_computes, mean_chunk_layers, tied_params
from megatronish.plan.rank_model import meta_chunks
from megatronish.plan.recompute import peaks_in_backward, policy, segments
from megatronish.spec import ModelSpec

FP32 = 4
HOST_ADAM_BYTES = 28  # torch's fused AdamW per element: reads param, grad, m, v; writes p, m, v


def zero_stage(layout: Layout) -> ZeroStage:
    """What the layout's ZeRO stage shards (the trainer's table)."""
    return ZERO_STAGES[layout.zero_stage]


def grad_group(layout: Layout) -> str:
    """The CommStats name of the group dense grads are reduced over: dp, dp x cp, or hybrid
    sharding's shard group."""
    return layout.group("zero_shard")


def replica_group(layout: Layout) -> str | None:
    """The CommStats name of hybrid sharding's replica group (None without replicas)."""
    return layout.group("zero_replica") if layout.zero_replicas > 1 else None


# -- states -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateBytes:
    """One rank's states. ``*_step`` adds what exists only during forward/backward."""

    param_numel: int  # parameters of this rank's chunks (a tp shard of each)
    buffer_numel: int  # the same, padded per bucket to a multiple of dp
    largest_bucket_numel: int
    params: int  # between steps
    grads: int  # between steps
    optimizer: int
    params_step: int  # zero 3: most full params gathered at once (units, prefetch included)
    grads_step: int  # zero 2/3: most full grad buffers alive at once (in a backward)
    grads_at_peak: int = 0  # zero 2/3: those alive when activations peak (see state_bytes)
    largest_shard_numel: int = 0  # the largest bucket's slice a rank owns under zero >= 1
    experts: int = 0  # of ``total``: the experts' params, grads and Adam moments
    compression: int = 0  # the gradient compression's error feedback (and PowerSGD's Q)
    # optimizer offload: host bytes (the pinned slabs of fp32 main params, the grads copied
    # down and the updated params' staging copy in the model's dtype, each rounded up to a
    # power of two as torch pins it; the Adam moments); not part of ``total``
    host: int = 0
    owned_numel: int = 0  # elements whose optimizer state (and update) this rank holds

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.compression

    @property
    def total_step(self) -> int:
        """States at the activation peak of a step."""
        return self.total + self.params_step + self.grads_at_peak


def chunk_buckets(chunk: GPTChunk, layout: Layout) -> list[Bucket]:
    """One chunk's buckets (on meta), as the trainer groups them."""
    return plan_chunk_buckets(
        chunk,
        int(layout.bucket_size_mb * 2**20),
        layout.zero_shard_ranks,
        0,
        tied_params(chunk.spec, layout),
        torch.device("meta"),
        per_unit=zero_stage(layout).shards_grads,
        **expert_dp(layout),
    )


def step_grad_numel(buckets_of: list[list[Bucket]]) -> int:
    """Zero 2/3: most full-grad elements alive at once in a step: every late bucket (reduced at
    the end) and, of the others (reduced per microbatch, in backward order, all finished when a
    chunk's backward ends), the one filling plus the ``MAX_IN_FLIGHT`` reductions before it."""
    late = sum(b.numel for bs in buckets_of for b in bs if b.late)
    window = MAX_IN_FLIGHT + 1
    runs = [[b.numel for b in bs if not b.late] for bs in buckets_of]
    most = max((sum(r[i : i + window]) for r in runs for i in range(len(r))), default=0)
    return late + most


def state_bytes(
    spec: ModelSpec,
    layout: Layout,
    pp_rank: int,
    chunks: list[GPTChunk] | None = None,
    buckets: list[list[Bucket]] | None = None,
    units: list[ChunkUnits] | None = None,
) -> StateBytes:
    """Params, grads and Adam moments held by a rank of pipeline stage ``pp_rank`` (``chunks``:
    that rank's :func:`~megatronish.plan.rank_model.meta_chunks`, ``buckets``: their
    :func:`chunk_buckets`, ``units``: their :func:`rank_units`, when the caller has them)."""
    chunks = chunks if chunks is not None else meta_chunks(spec, layout, pp_rank)
    stage = zero_stage(layout)
    if buckets is None:
        buckets = [chunk_buckets(c, layout) for c in chunks]
    per_chunk = [[b.numel for b in bs] for bs in buckets]
    numel = sum(sum(n) for n in per_chunk)
    param_numel = sum(p.numel() for c in chunks for p in c.parameters())
    model = layout.activation_bytes  # the model's params: fp32, or bf16 beside fp32 main params
    params, grads, optimizer = _held(buckets, stage, model)
    experts = sum(_held([[b for bs in buckets for b in bs if b.expert]], stage, model))
    host, owned = 0, _owned_numel(buckets, stage)
    if layout.optimizer_offload:  # main params, moments and the grads copied down: host
        params -= owned * FP32 if model != FP32 else 0
        host, optimizer = offload_pinned_bytes(owned, model) + optimizer, 0
    compression = grad_compression.state_bytes(layout, buckets)
    grads_step = step_grad_numel(buckets) * FP32 if stage.shards_grads else 0
    # Activations peak at the end of a forward, when only the late buckets (reduced at the end
    # of the step) hold full grads; under full recompute they peak in backward, beside the rest.
    late = sum(b.numel for bs in buckets for b in bs if b.late) * FP32 if stage.shards_grads else 0
    grads_at_peak = grads_step if peaks_in_backward(layout) else late
    params_step = 0
    if stage.shards_params:
        units = units if units is not None else rank_units(layout, chunks)
        params_step = rank_peak_gathered(units, layout.zero3_keep_gathered) * model
    return StateBytes(
        param_numel=param_numel,
        buffer_numel=numel,
        largest_bucket_numel=max(max(n) for n in per_chunk),
        params=params,
        grads=grads,
        optimizer=optimizer,
        params_step=params_step,
        grads_step=grads_step,
        grads_at_peak=grads_at_peak,
        largest_shard_numel=max(b.numel // b.dp for bs in buckets for b in bs),
        experts=experts,
        compression=compression,
        host=host,
        owned_numel=owned,
    )


def offload_pinned_bytes(owned: int, model: int) -> int:
    """Optimizer offload's pinned slabs for ``owned`` elements (params of ``model`` bytes each):
    one per kind (:func:`~megatronish.data_parallel.offload.slab_dtypes`), each rounded up as
    torch's pinned allocator rounds it (the Adam moments beside them are pageable)."""
    dtype = torch.float32 if model == FP32 else torch.bfloat16
    return sum(pinned_block_bytes(owned * t.itemsize) for t in slab_dtypes(dtype).values())


def _owned_numel(buckets: list[list[Bucket]], stage: ZeroStage) -> int:
    """Elements of ``buckets`` whose optimizer state a rank holds (its shards, or all)."""
    if stage.shards_optimizer_state:
        return sum(b.numel // b.dp for bs in buckets for b in bs)
    return sum(b.numel for bs in buckets for b in bs)


def _held(buckets: list[list[Bucket]], stage: ZeroStage, model: int) -> tuple[int, int, int]:
    """Bytes of params, grads and Adam moments of ``buckets`` between steps (a rank's shard of
    each bucket: ``numel / dp`` of the ranks it is sharded over)."""
    numel = sum(b.numel for bs in buckets for b in bs)
    shard = sum(b.numel // b.dp for bs in buckets for b in bs)
    owned = shard if stage.shards_optimizer_state else numel
    params = (shard if stage.shards_params else numel) * model + (
        owned * FP32 if model != FP32 else 0
    )
    grads = (shard if stage.shards_grads else numel) * FP32
    return params, grads, 2 * owned * FP32


def states_key(layout: Layout) -> tuple:
    """The layout fields :func:`state_bytes` reads besides the rank's chunks and shape."""
    stage = zero_stage(layout)
    # ZeRO 3's gathered peak follows recompute; ZeRO 2/3's full grads alive at the activation
    # peak depend on full recompute.
    gathered_rc = policy(layout) if stage.shards_params else None
    full = stage.shards_grads and peaks_in_backward(layout)
    return (
        layout.dp_cp,
        layout.zero_shard_ranks,
        layout.optimizer_offload,
        grad_compression.state_key(layout),
        layout.zero_stage,
        layout.bucket_size_mb,
        layout.zero3_keep_gathered,
        gathered_rc,
        full,
    )


def buckets_key(layout: Layout) -> tuple:
    """The layout fields :func:`chunk_buckets` reads besides the chunk."""
    shards = layout.zero_shard_ranks
    return layout.dp_cp, shards, layout.bucket_size_mb, zero_stage(layout).shards_grads


def rank_units(layout: Layout, chunks: list[GPTChunk]) -> list[ChunkUnits] | None:
    """The units ZeRO 3 gathers of a rank's chunks (None below ZeRO 3)."""
    if not zero_stage(layout).shards_params:
        return None
    return [chunk_units(c, layout, tied_params(c.spec, layout)) for c in chunks]


def units_key(layout: Layout) -> tuple | None:
    """The layout fields :func:`rank_units` reads besides the chunks."""
    if not zero_stage(layout).shards_params:
        return None
    return layout.dp_cp, layout.zero_shard_ranks, layout.bucket_size_mb, policy(layout)


def optimizer_workspace(layout: Layout, states: StateBytes) -> int:
    """AdamW's ``sqrt(v)`` temporary of the largest owned bucket slice."""
    owned = states.largest_shard_numel
    if not zero_stage(layout).shards_optimizer_state:
        owned = states.largest_bucket_numel
    return owned * FP32


# -- ZeRO 3's gathered params -----------------------------------------------------------------


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


def chunk_units(chunk: GPTChunk, layout: Layout, is_tied) -> ChunkUnits:
    """``chunk``'s units (a meta-device GPT chunk) with the buckets the trainer would plan."""
    units, visits = chunk_visits(chunk, 0)
    buckets = plan_chunk_buckets(
        chunk,
        int(layout.bucket_size_mb * 2**20),
        layout.zero_shard_ranks,
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
    runs = segments(layout, n_blocks)
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


# -- communication ----------------------------------------------------------------------------


def dp_volume(
    layout: Layout, buckets: list[list[Bucket]], units: list[ChunkUnits] | None = None
) -> dict[str, tuple[int, int]]:
    """``{"dp/op": (calls, bytes)}``: grad reductions and param gathers, one call per bucket
    (``buckets``: this rank's, per chunk; ``units``: its chunks' units, needed for zero 3).
    With context parallelism the group is dp x cp, reported as ``dp_cp/op``; expert buckets
    under expert parallelism are reduced over ``edp`` (none when each expert is on one rank).

    Under hybrid sharding the dense buckets are reduced and gathered over the shard group
    (``zero_shard``), and each reduced shard is all-reduced once per step over ``zero_replica``.
    Zero 0/1 reduce each bucket once per step, zero 2/3 once per microbatch (the buckets reduced
    after a model-parallel sum once per step). Zero 1/2 gather the updated params once after the
    step; zero 3 gathers each unit before its forward and its backward (the loss's unit once),
    or once per step when kept gathered.
    """
    if layout.dp_cp == 1:
        return {}
    group, experts = grad_group(layout), expert_group(layout)
    flat = [b for bs in buckets for b in bs]
    if experts == group:  # experts, if any, are reduced with the dense buckets
        return _reduce_volume(layout, group, flat, units, None)
    dense_flat = [b for b in flat if not b.expert]
    dense = {}
    if layout.zero_shard_ranks > 1:
        dense = _reduce_volume(layout, group, dense_flat, units, False)
    replicas = replica_group(layout)
    if replicas is not None and dense_flat:  # each reduced shard once per step
        shards = sum(b.numel // b.dp for b in dense_flat) * layout.grad_reduce_bytes
        dense = add_volumes(dense, {f"{replicas}/all_reduce": (len(dense_flat), shards)})
    if experts is None:  # each expert on one rank of the dp x cp group: nothing to reduce
        return dense
    mine = [b for b in flat if b.expert]
    return add_volumes(dense, _reduce_volume(layout, experts, mine, units, True))


def _reduce_volume(
    layout: Layout, group: str, flat: list[Bucket], units: list[ChunkUnits] | None, experts
) -> dict[str, tuple[int, int]]:
    """:func:`dp_volume` of the buckets ``flat`` reduced over ``group`` (``experts``: which
    buckets of the zero-3 units they are; None: all)."""
    if not flat:
        return {}
    stage = zero_stage(layout)
    n, numel = len(flat), sum(b.numel for b in flat)
    rounds = reduction_rounds(layout, flat)
    compressed = grad_compression.reduction_volume(layout, group, flat, rounds)
    if not stage.reduce_scatters_grads:
        return compressed or {f"{group}/all_reduce": (n, numel * layout.grad_reduce_bytes)}
    reduced = sum(r * b.numel for r, b in zip(rounds, flat)) * layout.grad_reduce_bytes
    out = dict(compressed or {f"{group}/reduce_scatter": (sum(rounds), reduced)})
    calls, gathered = n, numel  # model params
    if stage.shards_params and not layout.zero3_keep_gathered:
        if units is None:
            raise ValueError("zero 3 needs the chunks' units to count its gathers")
        per_unit = [gathers_per_microbatch(cu, experts) for cu in units]
        calls = layout.num_microbatches * sum(c for c, _ in per_unit)
        gathered = layout.num_microbatches * sum(e for _, e in per_unit)
    out[f"{group}/all_gather"] = (calls, gathered * layout.activation_bytes)
    return out


def reduction_rounds(layout: Layout, flat: list[Bucket]) -> list[int]:
    """How many times a step reduces each bucket of ``flat``: once, or (zero 2/3) once per
    microbatch but for the buckets reduced after a model-parallel sum."""
    per_mb = zero_stage(layout).reduces_per_microbatch
    return [layout.num_microbatches if per_mb and not b.late else 1 for b in flat]


def compression_traffic(layout: Layout, buckets: list[list[Bucket]]) -> int:
    """Bytes the gradient compression reads and writes per step on a rank with ``buckets``
    (those reduced over more than one rank; :mod:`~megatronish.plan.grad_compression`)."""
    reduced = [b for bs in buckets for b in bs if b.dp > 1]
    return grad_compression.memory_traffic(layout, reduced, reduction_rounds(layout, reduced))


# -- step time --------------------------------------------------------------------------------


def offload_time(
    layout: Layout, states: StateBytes, hw: Hardware, compute: float, recompute: float
) -> float:
    """Optimizer offload's exposed seconds per step: the host's update (torch's fused AdamW
    reads and writes :data:`HOST_ADAM_BYTES` per owned element at ``hw.host_memory_bw``, between
    the backward and the next forward), and the copies that do not hide: the grads going down
    behind the last backward, the params coming up behind the next first forward, over
    ``hw.pcie_bw`` each way."""
    if not layout.optimizer_offload:
        return 0.0
    owned = states.owned_numel
    update = owned * HOST_ADAM_BYTES / hw.host_memory_bw
    down = owned * FP32 / hw.pcie_bw
    up = owned * layout.activation_bytes / hw.pcie_bw
    backward = (2 * compute / 3 + recompute) / layout.num_microbatches
    forward = compute / 3 / layout.num_microbatches
    return update + max(0.0, down - backward) + max(0.0, up - forward)


def exposed_dp_time(
    spec: ModelSpec,
    layout: Layout,
    hw: Hardware,
    times: dict[str, float],
    volume: dict[str, tuple[int, int]],
    compute: float,
    recompute: float,
    end: float,
) -> tuple[float, float]:
    """``(gathers inside the busy time, end)``: ZeRO 3's exposed gathers, and ``end`` (the
    exposed work after the last backward so far) plus the exposed ZeRO 1/2 gather and grad
    reductions (see the module docstring; ``times``/``volume``: the stage's seconds and
    ``(calls, bytes)`` per ``"group/op"``, expert grads merged into dp's)."""
    stage, dp = zero_stage(layout), grad_group(layout)
    gather = times.get(f"{dp}/all_gather", 0.0)
    zero3 = 0.0
    backward_all = 2 * compute / 3 + recompute
    if gather and hw.shared_cores:
        zero3, end = (gather, end) if stage.shards_params else (0.0, end + gather)
    elif gather and stage.shards_params:
        # Prefetched: a unit gathers while the one before it computes; the first unit of each
        # forward and backward waits (about one unit of a chunk's layers + 1).
        units = mean_chunk_layers(spec, layout) + 1
        zero3 = max(gather / units, gather - (compute + recompute))
    elif gather:  # zero 1/2: during the next step's first forward, its first bucket exposed
        first_forward = compute / 3 / layout.num_microbatches
        end += max(gather / volume[f"{dp}/all_gather"][0], gather - first_forward)
    for key in (f"{dp}/all_reduce", f"{dp}/reduce_scatter", f"{dp}/all_to_all"):
        if key not in times:
            continue
        reduce = times[key]
        if hw.shared_cores:
            end += reduce
            continue
        # Reductions overlap the backward that fills them, all but its last bucket: zero 0/1
        # reduce in the last microbatch's backward, zero 2/3 in every one (each backward
        # compute waits for its last bucket).
        one = reduce / volume[key][0]
        if stage.reduces_per_microbatch:
            computes = chunk_computes(layout)
            end += max(computes * one, reduce - backward_all)
        else:
            end += max(one, reduce - backward_all / layout.num_microbatches)
    replica_key = f"{replica_group(layout)}/all_reduce"
    if replica_key in times:  # behind the shards' last reductions, in the last backward
        reduce = times[replica_key]
        if hw.shared_cores:
            end += reduce
        else:
            one = reduce / volume[replica_key][0]
            end += max(one, reduce - backward_all / layout.num_microbatches)
    return zero3, end
