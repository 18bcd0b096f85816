"""Pipeline parallelism (``parallel.pp``, ``parallel.vpp``, ``parallel.pipeline_schedule``) in
the plan: which chunks a stage holds, how many microbatches' activations are in flight, the
bubble, and the messages between stages.

- **Chunks**: chunk ``c`` of the ``pp v`` lives on stage ``c % pp``; under ``zbv`` (v = 2, the
  chunks in a V) chunk ``c >= pp`` lives on stage ``2 pp - 1 - c``, so stage 0 holds the
  embedding and the head (:func:`~megatronish.model.build.chunk_ids_of_stage`).
- **In flight**: walking the rank's schedule (:func:`~megatronish.pipeline.schedule.
  schedule_ops`: a forward adds its chunk's activations, the matching backward frees them)
  gives Megatron's interleaving factor ``1 + (p - 1) / (p v)`` on the first stage for free.
  The zero-bubble schedules split the backward: B frees the chunk's activations but what its W
  needs (each layer's saved input and its output's grad), which W frees; the first chunk's B
  is its whole backward (its input takes no grad), so it keeps nothing for W. The peak stops
  changing after ``pp`` microbatches (``2 pp`` with two or more chunks per stage), so the
  planner walks at most that many (:func:`capped_microbatches`).
- **Bubble** (:func:`bubble`): 1F1B idles ``(p - 1) / (v m)`` of the busiest stage's work
  (:func:`~megatronish.pipeline.simulate.analytic_bubble`); ZB-H1 ``(p - 1)(f + b - w) / (m (f +
  b + w))`` and ZBV, with a chunk's forward, B and W times ``f``, ``b``, ``w``
  (:func:`op_times`), ``(p - 1)(f + b - w) / (2 m (f + b + w))`` when they are equal and what
  :func:`~megatronish.pipeline.simulate.simulate` measures otherwise (:func:`zbv_bubble`); on
  shared cores only the cores a stage's ranks leave idle (:func:`bubble_share`).
- **Messages** (:func:`pp_volume`): a microbatch's hidden state forward, its grad backward,
  across each of the ``p v - 1`` chunk boundaries between stages (``zbv``'s turn from chunk
  ``p - 1`` to ``p`` stays on stage ``p - 1``: no message; its neighbours exchange both ways);
  the tied embedding's grad all-reduce between the first and the last stage
  (:func:`embedding_volume`; none under ``zbv``, whose stage 0 holds both). Sends and receives
  are posted ahead and overlap compute in the steady state; the first microbatch's forward and
  the last one's backward cross every boundary in sequence, so two messages per boundary are
  exposed (:func:`exposed_pp_time`).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable

from torch import nn

from megatronish.config.pipeline_rules import resolve_pipeline_schedule
from megatronish.data_parallel.grads import tied_rule
from megatronish.model.build import chunk_ids_of_stage, stage_of_chunk
from megatronish.model.flops import split_backward_times
from megatronish.pipeline.grouping import training_steps, waited_counts
from megatronish.pipeline.ops import message
from megatronish.pipeline.schedule import schedule_ops, splits_backward, transfers_around, v_shape
from megatronish.pipeline.simulate import analytic_bubble, simulate
from megatronish.plan import recompute
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
    """Microbatches that give the same in-flight peak as the layout's: the warm-up of 1F1B and
    ZB-H1 holds at most pp of them, that of the interleaved schedule and of ZBV under 2 pp."""
    return min(layout.num_microbatches, layout.pp * (1 if layout.vpp == 1 else 2))


def walk_key(layout: Layout) -> tuple[int, str]:
    """What the in-flight walk of a stage reads beyond its chunks: the microbatches it walks
    (:func:`capped_microbatches`) and the schedule."""
    return capped_microbatches(layout), layout.schedule


def rank_peak_in_flight(
    layout: Layout,
    pp_rank: int,
    sizes: dict,
    kept: dict | None = None,
    rebuilt: dict | None = None,
) -> float:
    """:func:`peak_in_flight` of the layout's schedule on pipeline rank ``pp_rank``."""
    m, schedule = layout.num_microbatches, layout.schedule
    return peak_in_flight(
        layout.pp, layout.vpp, m, pp_rank, sizes, kept=kept, rebuilt=rebuilt, schedule=schedule
    )


def peak_in_flight(
    pp: int,
    vpp: int,
    microbatches: int,
    pp_rank: int,
    sizes: dict,
    *,
    kept: dict | None = None,
    rebuilt: dict | None = None,
    schedule: str | None = None,
) -> float:
    """Peak of the bytes alive walking the rank's schedule, seen at each forward's end and in
    each backward (the workspaces of :func:`~megatronish.plan.estimate.activation_plan` come on
    top): ``sizes[chunk]`` from a forward to its backward. A split backward's B frees them but
    ``kept[chunk]`` (what its W needs: each layer's saved input and its output's grad), which
    its W frees; in the B they grow by what is kept beyond ``sizes`` and the group its workspace
    rebuilds (``rebuilt[chunk]``, full recompute: the last one it rebuilds holds the rest's W
    tensors). Without a pipeline one microbatch of every chunk at a time."""
    schedule = resolve_pipeline_schedule(schedule, vpp)
    mine = chunk_ids_of_stage(pp_rank, pp, vpp, v_shape(schedule))
    if pp == 1:
        return sum(sizes[c] for c in mine)
    if kept is None and splits_backward(schedule):
        raise ValueError(f"the {schedule} schedule's W needs the bytes it keeps: pass kept")
    rebuilt = rebuilt or {}
    live = peak = 0
    for op in schedule_ops(pp, vpp, microbatches, pp_rank, schedule):
        c = op.chunk
        if op.kind == "fwd":
            live += sizes[c]
            peak = max(peak, live)
        elif op.kind == "bwd":
            live -= sizes[c]
        elif op.kind == "bwd_input":
            peak = max(peak, live + max(0, kept[c] - sizes[c] - rebuilt.get(c, 0)))
            live += kept[c] - sizes[c]
        elif op.kind == "bwd_weight":
            live -= kept[c]
    return peak


def interleaving_factor(pp: int, vpp: int) -> float:
    """Korthikanti et al.'s factor on the first stage's ``pp`` in-flight microbatches under the
    interleaved schedule (vpp > 1); plain 1F1B keeps exactly ``pp``."""
    return 1 + (pp - 1) / (pp * vpp) if vpp > 1 else 1.0


def p2p_workspace(spec: ModelSpec, layout: Layout) -> int:
    """Pipeline buffers beside a compute: what the executor's groups hold then
    (:func:`p2p_buffers`, one hidden state each). 1F1B and ZB-H1 hold none (each compute
    waits for its group first, and a received grad is the backward's incoming grad); the early
    receives of interleaved 1F1B and of the V hold a few."""
    if layout.pp == 1:
        return 0
    m = min(layout.num_microbatches, 3 * layout.pp)  # more hold no more (tested)
    times = split_backward_times(spec)
    most = most_p2p_buffers(layout.pp, layout.vpp, m, layout.schedule, times)
    return most * hidden_bytes(spec, layout)


@functools.lru_cache(maxsize=256)
def most_p2p_buffers(
    pp: int, vpp: int, microbatches: int, schedule: str, times: tuple[float, float, float]
) -> int:
    """:func:`p2p_buffers` of the rank that has the most (every stage plans with it)."""
    return max(p2p_buffers(pp, vpp, microbatches, r, schedule, times) for r in range(pp))


def p2p_buffers(
    pp: int,
    vpp: int,
    microbatches: int,
    rank: int,
    schedule: str,
    times: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> int:
    """The most messages (activations or grads, one hidden state each) beside one of
    ``rank``'s computes, as the executor posts and waits for the schedule's groups
    (:func:`~megatronish.pipeline.grouping.training_steps`; ``times``: a chunk's relative F, B
    and W, with which the trainer plans): receives posted for a later compute, and sent
    outputs whose group the rank has not waited for yet (the group keeps them until then)."""
    waiting: set[tuple[str, int, int]] = set()
    unwaited: deque[int] = deque()  # sends of each posted group not yet waited for
    completed = most = 0
    steps = training_steps(pp, vpp, microbatches, rank, schedule, times)
    for step, need in zip(steps, waited_counts(steps), strict=True):
        waiting |= {message(op) for op in step.group if op.kind.startswith("recv")}
        if step.group:
            unwaited.append(sum(op.kind.startswith("send") for op in step.group))
        while completed < need:
            unwaited.popleft()
            completed += 1
        if step.compute is not None:
            needed, _ = transfers_around(pp, vpp, step.compute, schedule)
            waiting -= {message(op) for op in needed}
            most = max(most, len(waiting) + sum(unwaited))
    return most


def op_times(spec: ModelSpec, layout: Layout) -> tuple[float, float, float]:
    """Relative times of a chunk's forward, B and W (per token: ``2N + 4Lsh``, ``2N + 8Lsh``
    and ``2N``, :func:`~megatronish.model.flops.split_backward_times`), B with the forward work
    recompute repeats (it reruns in B, which needs the activations)."""
    f, b, w = split_backward_times(spec)
    return f, b + recompute.recompute_flops_per_token(spec, layout), w


def bubble(spec: ModelSpec, layout: Layout) -> float:
    """The share of compute the layout's schedule idles, 0 without a pipeline: ``(p - 1) / (v
    m)`` for 1F1B and interleaved 1F1B; ZB-H1 and ZBV from the chunk's op times
    (:func:`op_times`, the module docstring)."""
    if layout.pp == 1:
        return 0.0
    pp, m, schedule = layout.pp, layout.num_microbatches, layout.schedule
    if not splits_backward(schedule):
        return analytic_bubble(pp, layout.vpp, m)
    f, b, w = op_times(spec, layout)
    if schedule == "zb-h1":  # exact while w <= f and w <= b, as 2N <= 2N + 4Lsh is
        return analytic_bubble(pp, 1, m, schedule, f, b + w, w)
    return zbv_bubble(pp, m, f, b, w)


def zbv_bubble(pp: int, microbatches: int, f: float, b: float, w: float) -> float:
    """ZBV's bubble with forward, B and W times ``f``, ``b``, ``w`` per chunk op: the closed
    form when they are equal (:func:`~megatronish.pipeline.simulate.analytic_bubble`), else the
    simulated idle time (:func:`zbv_idle`). From ``2 pp`` microbatches on, the idle time no
    longer grows (every rank's steady state runs F, B, W of both chunks back to back), so the
    simulation runs at most ``2 pp`` of them and the fraction is that idle time over the
    step's ``2 m (f + b + w)``."""
    ratio_b, ratio_w = round(b / f, 4), round(w / f, 4)
    if ratio_b == ratio_w == 1.0:
        return analytic_bubble(pp, 2, microbatches, "zbv", f, b + w, w)
    idle = zbv_idle(pp, min(microbatches, 2 * pp), ratio_b, ratio_w)
    return idle / (2 * microbatches * (1.0 + ratio_b + ratio_w))


@functools.lru_cache(maxsize=4096)
def zbv_idle(pp: int, microbatches: int, b: float, w: float) -> float:
    """Idle time of a rank in ZBV's simulated step (the step's span less the rank's work, equal
    on every rank), in units of the forward's time, with B and W ``b`` and ``w`` times it
    (rounded ratios: the advisor asks for the same few many times)."""
    sim = simulate(pp, 2, microbatches, 1.0, b + w, schedule="zbv", weight_time=w)
    return max(sim.finish_time.values()) - sim.busy_time[0]


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
    msg = hidden_bytes(spec, layout)
    m = layout.num_microbatches
    sends = len(boundaries(layout, pp_rank))  # per boundary: activation out, grad back
    return {"pp/send": (m * sends, m * sends * msg), "pp/recv": (m * sends, m * sends * msg)}


def boundaries(layout: Layout, pp_rank: int) -> list[tuple[int, int]]:
    """``(chunk, neighbour)`` of stage ``pp_rank``'s chunks whose neighbour chunk lives on
    another stage: each sends one message per microbatch there and receives one back."""
    n, pp, v = layout.pp * layout.vpp, layout.pp, layout.v_shape
    mine = layout.stage_chunks(pp_rank)
    return [
        (c, d)
        for c in mine
        for d in (c - 1, c + 1)
        if 0 <= d < n and stage_of_chunk(d, pp, v) != pp_rank
    ]


def exposed_messages(layout: Layout) -> int:
    """Messages in sequence at the pipeline's fill and drain: the first microbatch's activation
    and the last one's grad across every boundary between stages (``2 (p v - 1)``; ZBV's turn
    is local: ``2 (2 p - 2)``)."""
    crossings = layout.pp * layout.vpp - 1
    return 2 * (crossings - 1 if layout.v_shape else crossings)


def embedding_volume(spec: ModelSpec, layout: Layout, pp_rank: int) -> dict[str, tuple[int, int]]:
    """The tied embedding's grad all-reduce between the first and the last stage."""
    if not spec.tie_embeddings or layout.pp == 1 or pp_rank not in (0, layout.pp - 1):
        return {}
    if layout.v_shape:  # the embedding and the head on stage 0: their grads are summed there
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
        exposed = calls if hw.shared_cores else exposed_messages(layout)
        worst = max(worst, exposed * one)
    return worst
