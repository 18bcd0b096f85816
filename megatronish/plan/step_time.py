"""An estimated step time of a planned layout: compute, pipeline bubble, communication.

The model (symbols: ``N`` ranks, ``t`` tp, ``p`` pp, ``v`` vpp, ``d`` dp, ``m`` microbatches,
``g`` GPUs per node):

- **Compute.** Each pipeline stage does the FLOPs of its layers (and the head on the last
  stage) for the ``tokens / d`` tokens of its pipeline, split over its ``t c`` ranks (``c``
  cp; the load-balanced split gives every cp rank the same causal attention work), at
  ``peak`` times the efficiency its matmuls' shapes allow
  (:mod:`~megatronish.plan.matmul_efficiency`: it rises with the micro batch's token rows and
  the tp-split weights' sizes and saturates at ``Hardware.efficiency``; recompute runs at the
  stage's efficiency too). Hardware FLOPs: recompute's repeated forward work is added (its
  part is reported as ``recompute``). The busiest stage sets the pace; with even layers it is the
  last one, which also computes the head. Mixture-of-experts blocks count their active weights
  (router, top-k and shared experts), as the model FLOPs do.
- **Bubble.** 1F1B idles ``(p - 1) / (v m)`` of the busiest stage's work
  (:func:`~megatronish.pipeline.schedule.analytic_bubble`).
- **Communication** uses the planner's per-stage volumes (calls, tensor bytes) of
  :mod:`~megatronish.plan.comm`. A call of ``B`` tensor bytes on a group of ``n`` ranks takes
  ``latency + f * B / bandwidth`` with the ring factors ``f = 2 (n - 1) / n`` (all-reduce),
  ``(n - 1) / n`` (all-gather, reduce-scatter) and 1 (send / recv). Ranks are laid out tp
  fastest, then cp, dp, pp, so a group's ranks are ``t`` (tp), ``t c`` (cp), ``t c d`` (dp, and
  dp x cp where grads are reduced under cp) or ``N`` (pp and the tied embedding) consecutive
  ranks; a group within ``g`` consecutive ranks runs at the
  intra-node bandwidth (NVLink), a larger one at the inter-node bandwidth (the NIC per GPU).
- **Overlap.** tp collectives sit between the matmuls that need them: never hidden; nor are
  cp's K/V all-gathers (forward) and reduce-scatters (backward), one of each per layer, nor
  expert parallelism's all-to-alls (the ``ep`` term: a rank sends ``(n - 1) / n`` of each
  tensor; an ep group spans ``t ep`` ranks). Expert grads are reduced and gathered over the
  expert-data-parallel group (``t c d`` span) with the dp ones and overlap as they do. ZeRO 3
  prefetches: a unit's (block's) gather runs while the unit before it computes, so only the
  first unit of each forward and backward waits: exposed = ``max(gathers / units per chunk,
  gathers - compute)``. ZeRO 1/2's gather of the updated params runs during the next step's
  first forward: exposed = ``max(one bucket, gather - that forward)``. The dp grad reduction
  starts bucket by bucket during the backward that fills it and hides behind it, except the
  last bucket: zero 0/1 reduce in the last microbatch's backward, exposed = ``max(one bucket,
  all reductions - that backward)``; zero 2/3 in every backward, each waiting for its last
  bucket, exposed = ``max(m v buckets, all reductions - all backwards)``. The tied-embedding
  all-reduce is exposed. Pipeline sends and receives are posted ahead and overlap compute in the
  steady state; the first microbatch's forward and the last one's backward cross every one of the
  ``p v - 1`` chunk boundaries in sequence, so ``2 (p v - 1)`` messages are exposed.
- **Shared cores** (CPU runs with more ranks than cores, ``Hardware.shared_cores``; fractional
  when other jobs take part of the machine): ``peak_flops``, the bandwidths and the latency
  are those of a rank with a core of its own, and every rank gets ``cores / N`` of a core for
  its compute and its communication alike; communication uses the cores compute needs, so
  nothing overlaps (all dp and pp transfers count); and a stage's idle time in the bubble is
  used by the other stages' ranks as long as a stage has at least ``cores`` ranks, so the
  bubble costs only the cores it leaves idle.

The step time is ``busiest stage (compute + recompute + tp + cp + ep + ZeRO 3 gathers) * (1 +
bubble) + exposed pp + the largest exposed end-of-step dp work``. Not modelled: the optimizer
update, data loading, kernel launch overheads, stragglers, and uneven routing (every expert is
assumed to get its share of the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megatronish.model.flops import layer_matmul_params, matmul_params
from megatronish.model.spec import ModelSpec
from megatronish.pipeline.schedule import analytic_bubble
from megatronish.plan import comm, moe
from megatronish.plan.estimate import Plan, recompute_flops_per_token
from megatronish.plan.layout import Layout
from megatronish.plan.matmul_efficiency import efficiency

TERMS = ("compute", "recompute", "bubble", "tp", "cp", "pp", "dp", "ep")


@dataclass(frozen=True)
class Hardware:
    """What a rank's device and network can do."""

    peak_flops: float  # per device, dense, in the compute dtype
    efficiency: float = 0.5  # fraction of peak large matmuls reach (plan/matmul_efficiency.py)
    memory_bw: float = 3.35e12  # bytes/s per device (an H100 SXM's HBM3): smaller matmuls' limit
    gpus_per_node: int = 8
    intra_node_bw: float = 450e9  # bytes/s per device and direction (NVLink)
    inter_node_bw: float = 50e9  # bytes/s per device and direction (one 400 Gb/s NIC per GPU)
    latency_s: float = 5e-6  # per collective call or pipeline message
    shared_cores: float | None = None  # CPU: all ranks share this many cores; None: a device each


@dataclass(frozen=True)
class StepTime:
    """Seconds per step by term; they add up to ``total``."""

    compute: float  # model FLOPs of the busiest stage
    recompute: float  # the forward work recompute repeats there
    bubble: float
    tp: float
    cp: float  # the K/V all-gathers and their grads' reduce-scatters (between computes)
    pp: float
    dp: float  # exposed dp communication: reductions, ZeRO gathers, tied embedding
    ep: float = 0.0  # expert parallelism's all-to-alls (between computes)

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def terms(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in TERMS}


def ring_factor(op: str, n: int) -> float:
    """Bytes each rank sends per tensor byte: ring all-reduce, all-gather / reduce-scatter, p2p."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def group_size_and_span(group: str, layout: Layout) -> tuple[int, int]:
    """Ranks in a group and how many consecutive ranks it spans (tp fastest, then cp, dp, pp)."""
    if group == "tp":
        return layout.tp, layout.tp
    if group == "cp":
        return layout.cp, layout.tp * layout.cp
    if group == "dp":
        return layout.dp, layout.tp * layout.cp * layout.dp
    if group == "dp_cp":
        return layout.dp_cp, layout.tp * layout.dp_cp
    if group == "ep":  # consecutive members of a dp x cp group
        return layout.ep, layout.tp * layout.ep
    if group == "edp":  # every ep-th member of a dp x cp group
        return layout.edp, layout.tp * layout.dp_cp
    return 2, layout.world_size  # pp neighbours and the embedding group: across the pipeline


def bandwidth(span: int, hw: Hardware) -> float:
    return hw.intra_node_bw if span <= hw.gpus_per_node else hw.inter_node_bw


def comm_time(layout: Layout, hw: Hardware, key: str, calls: int, nbytes: int) -> float:
    """Seconds of ``calls`` collectives (or messages) ``"group/op"`` moving ``nbytes`` tensor
    bytes in all, on a device of its own."""
    group, _, op = key.partition("/")
    n, span = group_size_and_span(group, layout)
    return calls * hw.latency_s + ring_factor(op, n) * nbytes / bandwidth(span, hw)


def stage_layers(spec: ModelSpec, layout: Layout, pp_rank: int) -> tuple[list[int], bool]:
    """The blocks of stage ``pp_rank``'s chunks, and whether it computes the head."""
    chunks = [pp_rank + v * layout.pp for v in range(layout.vpp)]
    per_chunk = layout.chunk_layers(spec.num_layers)
    ids = [i for c in chunks for i in range(sum(per_chunk[:c]), sum(per_chunk[: c + 1]))]
    return ids, len(per_chunk) - 1 in chunks


def stage_flops_per_token(spec: ModelSpec, layout: Layout, pp_rank: int) -> tuple[float, float]:
    """(model, recompute) FLOPs per token of the pipeline's tokens that stage ``pp_rank`` does."""
    L, s, h = spec.num_layers, spec.seq_length, spec.hidden_size
    head = spec.padded_vocab_size * h
    per_layer = 6.0 * (matmul_params(spec) - head) / L + 12.0 * s * h
    ids, has_head = stage_layers(spec, layout, pp_rank)
    model = len(ids) * per_layer + (6.0 * head if has_head else 0.0)
    if spec.moe is not None:  # blocks differ: the stage's own (active) weights
        own = sum(6.0 * layer_matmul_params(spec, i) + 12.0 * s * h for i in ids)
        model = own + (6.0 * head if has_head else 0.0)
    return model, recompute_flops_per_token(spec, layout) * len(ids) / L


def bubble_share(bubble: float, layout: Layout, hw: Hardware) -> float:
    """The part of the bubble that costs time: all of it on devices of their own; on shared
    cores only the cores a stage's ranks leave idle."""
    if not hw.shared_cores:
        return bubble
    per_stage = layout.world_size / layout.pp
    return bubble * max(0.0, 1.0 - per_stage / hw.shared_cores)


def slowdown(layout: Layout, hw: Hardware) -> float:
    """How much slower a rank runs than on a device of its own (ranks sharing fewer cores)."""
    return max(1.0, layout.world_size / hw.shared_cores) if hw.shared_cores else 1.0


@dataclass(frozen=True)
class _Stage:
    compute: float
    recompute: float
    tp: float
    cp: float
    zero3: float
    end: float  # exposed after the last backward: dp reduction, ZeRO 1/2 gather, embedding
    ep: float = 0.0

    @property
    def busy(self) -> float:
        return self.compute + self.recompute + self.tp + self.cp + self.zero3 + self.ep


def _stage_time(
    spec: ModelSpec, layout: Layout, pp_rank: int, volume: dict, hw: Hardware
) -> _Stage:
    """One stage's terms from its communication ``volume`` (``{"group/op": (calls, bytes)}``)."""
    slow = slowdown(layout, hw)
    rate = hw.peak_flops * efficiency(spec, layout, hw, *stage_layers(spec, layout, pp_rank)) / slow
    tokens = layout.global_batch_size * spec.seq_length / layout.dp
    model, extra = stage_flops_per_token(spec, layout, pp_rank)
    compute, recompute = (f * tokens / (layout.tp * layout.cp) / rate for f in (model, extra))
    times = {k: comm_time(layout, hw, k, c, b) * slow for k, (c, b) in volume.items()}
    tp = sum(t for k, t in times.items() if k.startswith("tp/"))
    cp = sum(t for k, t in times.items() if k.startswith("cp/"))
    ep = sum(t for k, t in times.items() if k.startswith("ep/"))
    dp = "dp_cp" if layout.cp > 1 else "dp"  # the group grads are reduced over
    if any(k.startswith("edp/") for k in volume):  # expert grads: with the dense ones
        times, volume = _with_experts(times, volume, dp)
    gather = times.get(f"{dp}/all_gather", 0.0)
    zero3, end = 0.0, times.get("embedding/all_reduce", 0.0)
    backward_all = 2 * compute / 3 + recompute
    if gather and hw.shared_cores:
        zero3, end = (gather, end) if layout.zero_stage == 3 else (0.0, end + gather)
    elif gather and layout.zero_stage == 3:
        # Prefetched: a unit gathers while the one before it computes; the first unit of each
        # forward and backward waits (about one unit of a chunk's layers + 1).
        units = spec.num_layers / (layout.pp * layout.vpp) + 1
        zero3 = max(gather / units, gather - (compute + recompute))
    elif gather:  # zero 1/2: during the next step's first forward, its first bucket exposed
        first_forward = compute / 3 / layout.num_microbatches
        end += max(gather / volume[f"{dp}/all_gather"][0], gather - first_forward)
    for key in (f"{dp}/all_reduce", f"{dp}/reduce_scatter"):
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
        if layout.zero_stage >= 2:
            computes = layout.num_microbatches * layout.vpp
            end += max(computes * one, reduce - backward_all)
        else:
            end += max(one, reduce - backward_all / layout.num_microbatches)
    return _Stage(compute, recompute, tp, cp, zero3, end, ep)


def _with_experts(times: dict, volume: dict, dp: str) -> tuple[dict, dict]:
    """``times`` and ``volume`` with the expert-data-parallel group's entries added to dp's."""
    times, volume = dict(times), dict(volume)
    for key in [k for k in volume if k.startswith("edp/")]:
        op = f"{dp}/{key.partition('/')[2]}"
        times[op] = times.get(op, 0.0) + times.pop(key)
        (calls, nbytes), (more, extra) = volume.get(op, (0, 0)), volume.pop(key)
        volume[op] = (calls + more, nbytes + extra)
    return times, volume


def _pp_time(layout: Layout, volumes: list[dict], hw: Hardware) -> float:
    """Exposed pipeline transfers: the fill and drain messages (all of a rank's on shared
    cores)."""
    worst = 0.0
    for volume in volumes:
        calls, nbytes = volume.get("pp/send", (0, 0))
        if not calls:
            continue
        one = comm_time(layout, hw, "pp/send", 1, nbytes // calls) * slowdown(layout, hw)
        exposed = calls if hw.shared_cores else 2 * (layout.pp * layout.vpp - 1)
        worst = max(worst, exposed * one)
    return worst


def _combine(layout: Layout, bubble: float, stages: list[_Stage], pp: float, hw) -> StepTime:
    busiest = max(stages, key=lambda s: s.busy)
    return StepTime(
        compute=busiest.compute,
        recompute=busiest.recompute,
        bubble=busiest.busy * bubble_share(bubble, layout, hw),
        tp=busiest.tp,
        cp=busiest.cp,
        pp=pp,
        dp=busiest.zero3 + max(s.end for s in stages),
        ep=busiest.ep,
    )


def step_time(plan: Plan, hw: Hardware) -> StepTime:
    """The model's step time of ``plan`` (see the module docstring)."""
    lay, spec = plan.layout, plan.spec
    stages = [_stage_time(spec, lay, s.pp_rank, s.comm, hw) for s in plan.stages]
    return _combine(lay, plan.bubble, stages, _pp_time(lay, [s.comm for s in plan.stages], hw), hw)


def lower_bound(spec: ModelSpec, layout: Layout, hw: Hardware) -> float:
    """A step time :func:`step_time` never goes below, known without planning memory: compute,
    the bubble, the pipeline transfers and the tp communication the layout would have without
    sequence parallelism (one all-reduce moves what an all-gather and a reduce-scatter do, in
    fewer calls), expert parallelism's all-to-alls; no dp communication."""
    bubble = 0.0
    if layout.pp > 1:
        bubble = analytic_bubble(layout.pp, layout.vpp, layout.num_microbatches)
    plain = layout.with_(sp=False)
    volumes, stages = [], []
    for r in sorted({0, layout.pp - 1}):
        volume = {
            **comm.tp_volume(spec, plain, r),
            **comm.cp_volume(spec, layout, r),
            **comm.pp_volume(spec, layout, r),
            **moe.ep_volume(spec, layout, moe.rank_blocks(spec, layout, r)),
        }
        volumes.append(volume)
        stages.append(_stage_time(spec, layout, r, volume, hw))
    return _combine(layout, bubble, stages, _pp_time(layout, volumes, hw), hw).total
