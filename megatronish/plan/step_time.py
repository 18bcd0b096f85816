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
- **Bubble.** The schedule's idle share of the busiest stage's work
  (:func:`~megatronish.plan.pipeline.bubble`): 1F1B ``(p - 1) / (v m)``, the zero-bubble
  schedules less (W fills the bubble).
- **Communication** uses the planner's per-stage volumes (calls, tensor bytes) of each feature
  (:mod:`~megatronish.plan.hardware` times them). A call of ``B`` tensor bytes on a group of
  ``n`` ranks takes ``latency + f * B / bandwidth`` with the ring factors ``f = 2 (n - 1) / n``
  (all-reduce), ``(n - 1) / n`` (all-gather, reduce-scatter) and 1 (send / recv). Ranks are laid
  out tp fastest, then cp, dp, pp, so a group's ranks are ``t`` (tp), ``t c`` (cp), ``t c d``
  (dp, and dp x cp where grads are reduced under cp) or ``N`` (pp and the tied embedding)
  consecutive ranks; a group within ``g`` consecutive ranks runs at the intra-node bandwidth
  (NVLink), a larger one at the inter-node bandwidth (the NIC per GPU).
- **Overlap.** tp collectives sit between the matmuls that need them: never hidden; nor are
  cp's K/V all-gathers (forward) and reduce-scatters (backward), one of each per layer, or its
  all-to-alls; ring attention's sends hide behind each step's block of attention as far as it
  lasts (:func:`~megatronish.plan.context_parallel.ring_overlap_time`; a receive is its peer's
  send and costs nothing more); nor are
  expert parallelism's all-to-alls (the ``ep`` term: a rank sends ``(n - 1) / n`` of each
  tensor; an ep group spans ``t ep`` ranks), except the part of each forward's rows exchange
  the shared experts' forward hides (:func:`~megatronish.plan.moe.overlapped_dispatch_time`).
  Expert grads are reduced and gathered over the expert-data-parallel group (``t c d`` span)
  with the dp ones and overlap as they do. ZeRO 3
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
  ``p v - 1`` chunk boundaries in sequence, so ``2 (p v - 1)`` messages are exposed (ZBV's turn
  between its legs is local, one boundary fewer).
- **Shared cores** (CPU runs with more ranks than cores, ``Hardware.shared_cores``; fractional
  when other jobs take part of the machine): ``peak_flops``, the bandwidths and the latency
  are those of a rank with a core of its own, and every rank gets ``cores / N`` of a core for
  its compute and its communication alike; communication uses the cores compute needs, so
  nothing overlaps (all dp and pp transfers count); and a stage's idle time in the bubble is
  used by the other stages' ranks as long as a stage has at least ``cores`` ranks, so the
  bubble costs only the cores it leaves idle.

This file only adds the terms up: the FLOPs, the bubble and the exposed pipeline transfers are
:mod:`~megatronish.plan.pipeline`'s and the blocks' (:mod:`~megatronish.plan.dense`,
:mod:`~megatronish.plan.moe`, :mod:`~megatronish.plan.recompute`), the exposed dp work
:func:`~megatronish.plan.data_parallel.exposed_dp_time`'s, plus the gradient compression's
memory traffic at the memory bandwidth (:mod:`~megatronish.plan.grad_compression`).

The step time is ``busiest stage (compute + recompute + tp + cp + ep + ZeRO 3 gathers) * (1 +
bubble) + exposed pp + the largest exposed end-of-step dp work``. Not modelled: the optimizer
update, data loading, kernel launch overheads, stragglers, and uneven routing (every expert is
assumed to get its share of the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megatronish.plan import context_parallel, data_parallel, dense, moe, pipeline, recompute
from megatronish.plan.data_parallel import StateBytes
from megatronish.plan.estimate import Plan
from megatronish.plan.hardware import Hardware, add_volumes, comm_time, slowdown
from megatronish.plan.layout import Layout
from megatronish.plan.matmul_efficiency import efficiency
from megatronish.spec import ModelSpec

TERMS = ("compute", "recompute", "bubble", "tp", "cp", "pp", "dp", "ep")
BETWEEN_COMPUTES = ("tp", "cp", "ep")  # groups whose collectives are never hidden


def _term(key: str) -> str:
    """The step time term of a ``"group/op"`` key (a2a_ring's two cp groups count as cp)."""
    group = key.partition("/")[0]
    return "cp" if group in ("cp_a2a", "cp_ring") else group


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


def stage_flops_per_token(spec: ModelSpec, layout: Layout, pp_rank: int) -> tuple[float, float]:
    """(model, recompute) FLOPs per token of the pipeline's tokens that stage ``pp_rank`` does."""
    ids, has_head = pipeline.stage_layers(spec, layout, pp_rank)
    model = moe.stage_flops_per_token(spec, ids, has_head)
    extra = recompute.recompute_flops_per_token(spec, layout) * len(ids) / spec.num_layers
    return model, extra


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
    spec: ModelSpec,
    layout: Layout,
    pp_rank: int,
    volume: dict,
    hw: Hardware,
    compression_traffic: int = 0,
    states: StateBytes | None = None,
) -> _Stage:
    """One stage's terms from its communication ``volume`` (``{"group/op": (calls, bytes)}``),
    the bytes its gradient compression reads and writes (at the memory bandwidth, exposed at the
    end of the step) and its ``states`` (optimizer offload's host update and copies)."""
    slow = slowdown(layout, hw)
    layers = pipeline.stage_layers(spec, layout, pp_rank)
    rate = hw.peak_flops * efficiency(spec, layout, hw, *layers) / slow
    tokens = layout.replica_tokens(spec.seq_length)
    model, extra = stage_flops_per_token(spec, layout, pp_rank)
    ranks = layout.stage_ranks
    compute, recompute_s = (f * tokens / ranks / rate for f in (model, extra))
    times = {k: comm_time(layout, hw, k, c, b) * slow for k, (c, b) in volume.items()}
    tp, cp, ep = (
        sum(t for k, t in times.items() if _term(k) == term and not k.endswith("/recv"))
        for term in BETWEEN_COMPUTES
    )  # a receive is its peer's send
    ep -= moe.overlapped_dispatch_time(spec, layout, hw, pp_rank, rate)
    cp -= context_parallel.ring_overlap_time(spec, layout, hw, pp_rank, rate)
    times, volume = moe.merge_expert_grads(times, volume, layout, data_parallel.grad_group(layout))
    zero3, end = data_parallel.exposed_dp_time(
        spec, layout, hw, times, volume, compute, recompute_s, pipeline.embedding_time(times)
    )
    end += compression_traffic / hw.memory_bw * slow
    if states is not None:
        end += data_parallel.offload_time(layout, states, hw, compute, recompute_s) * slow
    return _Stage(compute, recompute_s, tp, cp, zero3, end, ep)


def _combine(layout: Layout, bubble: float, stages: list[_Stage], pp: float, hw) -> StepTime:
    busiest = max(stages, key=lambda s: s.busy)
    return StepTime(
        compute=busiest.compute,
        recompute=busiest.recompute,
        bubble=busiest.busy * pipeline.bubble_share(bubble, layout, hw),
        tp=busiest.tp,
        cp=busiest.cp,
        pp=pp,
        dp=busiest.zero3 + max(s.end for s in stages),
        ep=busiest.ep,
    )


def step_time(plan: Plan, hw: Hardware) -> StepTime:
    """The model's step time of ``plan`` (see the module docstring)."""
    lay, spec = plan.layout, plan.spec
    stages = [
        _stage_time(spec, lay, s.pp_rank, s.comm, hw, s.compression_traffic, s.states)
        for s in plan.stages
    ]
    pp = pipeline.exposed_pp_time(lay, [s.comm for s in plan.stages], hw)
    return _combine(lay, plan.bubble, stages, pp, hw)


def lower_bound(spec: ModelSpec, layout: Layout, hw: Hardware) -> float:
    """A step time :func:`step_time` never goes below, known without planning memory: compute,
    the bubble, the pipeline transfers and the tp communication the layout would have without
    sequence parallelism (one all-reduce moves what an all-gather and a reduce-scatter do, in
    fewer calls), expert parallelism's all-to-alls; no dp communication."""
    plain = layout.with_(sp=False)
    volumes, stages = [], []
    for r in pipeline.end_stages(layout):
        blocks = moe.rank_blocks(spec, layout, r)
        volume = add_volumes(
            dense.tp_volume(spec, plain, r),
            context_parallel.cp_volume(spec, layout, r),
            moe.cp_counts_volume(spec, layout, blocks),
            pipeline.pp_volume(spec, layout, r),
            moe.ep_volume(spec, layout, blocks),
        )
        volumes.append(volume)
        stages.append(_stage_time(spec, layout, r, volume, hw))
    pp = pipeline.exposed_pp_time(layout, volumes, hw)
    return _combine(layout, pipeline.bubble(spec, layout), stages, pp, hw).total
