"""Pipeline parallelism (``parallel.pp``, ``parallel.vpp``) in the plan: which chunks a stage
holds, how many microbatches' activations are in flight, the bubble, and the messages between
stages.

- **Chunks**: chunk ``c`` of the ``pp v`` lives on stage ``c % pp``
  (:func:`~megatronish.model.build.chunk_ids_of_stage`); the last one computes the head.
- **In flight**: walking the rank's schedule (:func:`~megatronish.pipeline.schedule.
  schedule_ops`: a forward adds its chunk's activations, the matching backward frees them) gives
  Megatron's interleaving factor ``1 + (p - 1) / (p v)`` on the first stage for free. The peak
  stops changing after ``pp`` microbatches (``2 pp`` interleaved), so the planner walks at most
  that many (:func:`capped_microbatches`).
- **Bubble**: 1F1B idles ``(p - 1) / (v m)`` of the busiest stage's work
  (:func:`~megatronish.pipeline.schedule.analytic_bubble`); on shared cores only the cores a
  stage's ranks leave idle (:func:`bubble_share`).
- **Messages** (:func:`pp_volume`): a microbatch's hidden state forward, its grad backward,
  across each of the ``p v - 1`` chunk boundaries; the tied embedding's grad all-reduce between
  the first and the last stage (:func:`embedding_volume`). Sends and receives are posted ahead
  and overlap compute in the steady state; the first microbatch's forward and the last one's
  backward cross every boundary in sequence, so ``2 (p v - 1)`` messages are exposed
  (:func:`exposed_pp_time`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from megatronish.data_parallel.grads import tied_rule
from megatronish.model.build import chunk_ids_of_stage
from megatronish.pipeline.schedule import analytic_bubble, schedule_ops
from megatronish.plan.dense import embedding_numel, hidden_bytes
from megatronish.plan.hardware import Hardware, comm_time, slowdown
from megatronish.plan.layout import Layout
from megatronish.spec import ModelSpec

FP32 = 4


def stage_layers(spec: ModelSpec, layout: Layout, pp_rank: int) -> tuple[list[int], bool]:
    """The blocks of stage ``pp_rank``'s chunks, and whether it computes the head."""
    chunks = layout.stage_chunks(pp_rank)
    per_chunk = layout.chunk_layers(spec.num_layers)
    ids = [i for c in chunks for i in range(sum(per_chunk[:c]), sum(per_chunk[: c + 1]))]
    return ids, len(per_chunk) - 1 in chunks


def representative_stages(pp: int) -> list[int]:
    """The pipeline ranks a cached plan covers: first, second and last."""
    return sorted({0, min(1, pp - 1), pp - 1})


def planned_stages(layout: Layout, representative: bool) -> list[int]:
    """The pipeline ranks a plan lists: every one, or the representative ones."""
    return representative_stages(layout.pp) if representative else list(range(layout.pp))


def end_stages(layout: Layout) -> list[int]:
    """The first and the last pipeline rank (the busiest: the embedding, the head)."""
    return sorted({0, layout.pp - 1})


def mean_chunk_layers(spec: ModelSpec, layout: Layout) -> float:
    """Blocks of a model chunk on average (``L / (p v)``)."""
    return spec.num_layers / (layout.pp * layout.vpp)


def chunk_computes(layout: Layout) -> int:
    """Forwards (and as many backwards) a rank computes per step: one per microbatch and chunk it
    holds (``m v``)."""
    return layout.num_microbatches * layout.vpp


def tied_params(spec: ModelSpec, layout: Layout) -> Callable[[str, nn.Parameter], bool]:
    """The trainer's ``is_tied(name, p)``: the params whose grads are summed between the first
    and the last stage (a word embedding tied to a head on another stage, head copies)."""
    return tied_rule(spec.tie_embeddings, layout.pp)


def capped_microbatches(layout: Layout) -> int:
    """Microbatches that give the same in-flight peak as the layout's: 1F1B's warm-up holds at
    most pp of them, the interleaved one's under 2 pp."""
    return min(layout.num_microbatches, layout.pp * (1 if layout.vpp == 1 else 2))


def rank_peak_in_flight(layout: Layout, pp_rank: int, sizes: dict) -> float:
    """:func:`peak_in_flight` of the layout's schedule on pipeline rank ``pp_rank``."""
    return peak_in_flight(layout.pp, layout.vpp, layout.num_microbatches, pp_rank, sizes)


def peak_in_flight(pp: int, vpp: int, microbatches: int, pp_rank: int, sizes: dict) -> float:
    """Peak of ``sum(sizes[chunk])`` over forwards whose backward has not run yet, walking the
    rank's schedule; without a pipeline one microbatch of every chunk at a time."""
    mine = chunk_ids_of_stage(pp_rank, pp, vpp)
    if pp == 1:
        return sum(sizes[c] for c in mine)
    live = peak = 0
    for op in schedule_ops(pp, vpp, microbatches, pp_rank):
        if op.kind == "fwd":
            live += sizes[op.chunk]
            peak = max(peak, live)
        elif op.kind == "bwd":
            live -= sizes[op.chunk]
    return peak


def interleaving_factor(pp: int, vpp: int) -> float:
    """Korthikanti et al.'s factor on the first stage's ``pp`` in-flight microbatches under the
    interleaved schedule (vpp > 1); plain 1F1B keeps exactly ``pp``."""
    return 1 + (pp - 1) / (pp * vpp) if vpp > 1 else 1.0


def p2p_workspace(spec: ModelSpec, layout: Layout) -> int:
    """Pipeline buffers beside a compute. Groups complete before the next compute, so 1F1B holds
    none there (a received grad is the backward's incoming grad); interleaved 1F1B receives a
    pair's grad before its forward and sends the forward's output after its backward: one
    activation (``pipeline/grouping.py``)."""
    if layout.pp == 1 or layout.vpp == 1:
        return 0
    return hidden_bytes(spec, layout)


def bubble(layout: Layout) -> float:
    """The share of compute the schedule idles: ``(p - 1) / (v m)``, 0 without a pipeline."""
    if layout.pp == 1:
        return 0.0
    return analytic_bubble(layout.pp, layout.vpp, layout.num_microbatches)


def bubble_share(share: float, layout: Layout, hw: Hardware) -> float:
    """The part of the bubble ``share`` that costs time: all of it on devices of their own; on
    shared cores only the cores a stage's ranks leave idle."""
    if not hw.shared_cores:
        return share
    per_stage = layout.world_size / layout.pp
    return share * max(0.0, 1.0 - per_stage / hw.shared_cores)


def pp_volume(spec: ModelSpec, layout: Layout, pp_rank: int) -> dict[str, tuple[int, int]]:
    """``{"pp/send"|"pp/recv": (calls, bytes)}``: activations forward, their grads backward."""
    if layout.pp == 1:
        return {}
    n = layout.pp * layout.vpp
    msg = hidden_bytes(spec, layout)
    m = layout.num_microbatches
    mine = layout.stage_chunks(pp_rank)
    sends = sum((c < n - 1) + (c > 0) for c in mine)  # activation out, grad back
    return {"pp/send": (m * sends, m * sends * msg), "pp/recv": (m * sends, m * sends * msg)}


def embedding_volume(spec: ModelSpec, layout: Layout, pp_rank: int) -> dict[str, tuple[int, int]]:
    """The tied embedding's grad all-reduce between the first and the last stage."""
    if not spec.tie_embeddings or layout.pp == 1 or pp_rank not in (0, layout.pp - 1):
        return {}
    return {"embedding/all_reduce": (1, embedding_numel(spec, layout) * FP32)}


def embedding_time(times: dict[str, float]) -> float:
    """Seconds of the tied embedding's all-reduce (exposed: after the last backward)."""
    return times.get("embedding/all_reduce", 0.0)


def exposed_pp_time(layout: Layout, volumes: list[dict], hw: Hardware) -> float:
    """Exposed pipeline transfers of the stages' ``volumes``: the fill and drain messages (all of
    a rank's on shared cores)."""
    worst = 0.0
    for volume in volumes:
        calls, nbytes = volume.get("pp/send", (0, 0))
        if not calls:
            continue
        one = comm_time(layout, hw, "pp/send", 1, nbytes // calls) * slowdown(layout, hw)
        exposed = calls if hw.shared_cores else 2 * (layout.pp * layout.vpp - 1)
        worst = max(worst, exposed * one)
    return worst
