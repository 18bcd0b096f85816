"""The layout advisor: which valid layouts of a job fit the devices, ranked by estimated step time.

:func:`advise` enumerates every layout the trainer accepts
(:func:`~megatronish.plan.candidates.valid_layouts`), plans each one's memory and communication
(:class:`~megatronish.plan.estimate.Planner` on representative stages: ``make_plan``'s peak),
drops those whose peak plus the runtime's own bytes exceeds the device, and ranks the rest by
:func:`~megatronish.plan.step_time.step_time`. Layouts are planned in order of a lower bound of
their step time (:func:`~megatronish.plan.step_time.lower_bound`, which needs no memory plan);
once the fastest layouts of ``top + 1`` (tp, cp, pp, ep) combinations that fit are known, a layout
whose bound is slower than all of them cannot enter the table and is not planned. The table lists
the fastest layout of each (tp, cp, pp, ep) combination (ep is 1 for a dense model; the others
differ only in vpp, pipeline schedule, ZeRO stage, sp, recompute or micro batch); :func:`reason`
says in words why a row beats the next.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, replace

from megatronish.config.schema import TrainConfig
from megatronish.plan.candidates import valid_layouts
from megatronish.plan.estimate import Plan, Planner
from megatronish.plan.layout import Layout
from megatronish.plan.recompute import POLICIES
from megatronish.plan.step_time import Hardware, StepTime, lower_bound, step_time
from megatronish.spec import ModelSpec

RECOMPUTE_ORDER = {policy: i for i, policy in enumerate(POLICIES)}  # none, selective, full


@dataclass(frozen=True)
class Ranked:
    """A layout that fits, with its plan and estimated step time."""

    plan: Plan
    time: StepTime
    key: tuple = ()  # fastest first; on a tie the lower ZeRO stage, less recompute, less memory

    @classmethod
    def of(cls, plan: Plan, time: StepTime) -> Ranked:
        lay = plan.layout
        key = (
            time.total,
            lay.zero_stage,
            RECOMPUTE_ORDER[lay.recompute],
            plan.peak_bytes,
            lay.describe(),
        )
        return cls(plan, time, key)

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(tp, cp, pp, ep): the table lists the fastest layout of each."""
        return self.layout.tp, self.layout.cp, self.layout.pp, self.layout.ep


@dataclass(frozen=True)
class Advice:
    """The outcome of :func:`advise`."""

    valid: int  # layouts the trainer accepts on this many ranks
    planned: int  # layouts planned (the others could not reach the top)
    too_big: int  # planned layouts that do not fit
    ranked: list[Ranked]  # planned layouts that fit, fastest first
    least_peak: int = 0  # the smallest planned peak of a layout that does not fit
    offloaded: bool = False  # nothing fit on the device: these have their optimizer on the host

    def best_of_each_shape(self) -> list[Ranked]:
        """The fastest layout of every (tp, cp, pp, ep), fastest first."""
        seen, out = set(), []
        for r in self.ranked:
            if r.shape not in seen:
                seen.add(r.shape)
                out.append(r)
        return out


def advise(
    cfg: TrainConfig,
    spec: ModelSpec,
    world_size: int,
    hw: Hardware,
    device_bytes: int,
    runtime_bytes: int,
    top: int = 10,
    planner: Planner | None = None,
) -> Advice:
    """Rank the layouts of ``cfg``'s job on ``world_size`` ranks that fit ``device_bytes`` per
    rank; planning stops once the fastest layouts of ``top + 1`` (tp, cp, pp, ep) shapes are
    known (the last listed one needs a runner-up). ``planner``: one of ``spec`` whose plans
    earlier calls made (a device of another size or speed needs no new plans). When no layout
    fits, the same layouts are ranked once more with their optimizer offloaded to the host
    (``offloaded``: slower, so only then)."""
    layouts = valid_layouts(cfg, world_size, spec.vocab_size, hw.gpus_per_node)
    planner = planner or Planner(spec)
    advice = _rank(spec, layouts, hw, device_bytes, runtime_bytes, top, planner)
    if advice.ranked or not layouts:
        return advice
    offloaded = [x.with_(optimizer_offload=True) for x in layouts]
    again = _rank(spec, offloaded, hw, device_bytes, runtime_bytes, top, planner)
    return replace(
        again,
        planned=advice.planned + again.planned,
        too_big=advice.too_big + again.too_big,
        least_peak=min(advice.least_peak, again.least_peak) or again.least_peak,
        offloaded=True,
    )


def _rank(
    spec: ModelSpec,
    layouts: list[Layout],
    hw: Hardware,
    device_bytes: int,
    runtime_bytes: int,
    top: int,
    planner: Planner,
) -> Advice:
    """:func:`advise`'s ranking of ``layouts``."""
    bound_of: dict[Layout, float] = {}  # the bound has no dp term: ZeRO stages share it

    def bound(lay: Layout) -> float:
        key = lay.with_(
            zero_stage=0, zero_shard_size=None, grad_compression=None, optimizer_offload=False
        )
        if key not in bound_of:
            bound_of[key] = lower_bound(spec, key, hw)
        return bound_of[key]

    bounds = sorted((bound(lay), i) for i, lay in enumerate(layouts))
    ranked: list[Ranked] = []
    best: dict[tuple, float] = {}  # fastest time of each shape
    bar = math.inf  # the (top + 1)-th fastest shape's time
    planned = too_big = 0
    least_peak = math.inf
    for bound, i in bounds:
        if bound > bar:
            break
        plan = planner.plan(layouts[i], representative=True)
        planned += 1
        if not plan.fits(device_bytes, runtime_bytes):
            too_big += 1
            least_peak = min(least_peak, plan.peak_bytes)
            continue
        r = Ranked.of(plan, step_time(plan, hw))
        bisect.insort(ranked, r, key=lambda x: x.key)
        if r.time.total < best.get(r.shape, math.inf):
            best[r.shape] = r.time.total
            if len(best) > top:
                bar = heapq.nsmallest(top + 1, best.values())[-1]
    return Advice(
        valid=len(layouts),
        planned=planned,
        too_big=too_big,
        ranked=ranked,
        least_peak=0 if least_peak == math.inf else int(least_peak),
    )


def _term_phrase(term: str, win: Ranked, lose: Ranked, hw: Hardware) -> str:
    """Words for a model term in which ``win`` spends less time than ``lose``."""
    w, lo = win.layout, lose.layout
    if term == "bubble":
        if win.time.bubble == 0:
            return "no bubble"
        if w.schedule != lo.schedule and w.pp > 1:
            return f"a smaller bubble ({w.schedule})"
        return "a smaller bubble"
    if term == "tp":
        if w.tp == 1:
            return "no tp communication"
        if w.tp <= hw.gpus_per_node < lo.tp:
            return "tp inside a node"
        return "less tp communication"
    if term == "cp":
        if w.cp == 1:
            return "no cp communication"
        if (w.cp_comm_type, w.cp_a2a_size) != (lo.cp_comm_type, lo.cp_a2a_size):
            size = f"/{w.cp_a2a_size}" if w.cp_comm_type == "a2a_ring" else ""
            return f"less exposed cp communication ({w.cp_comm_type}{size})"
        return "less cp communication"
    if term == "pp":
        return "no pipeline transfers" if w.pp == 1 else "fewer exposed pipeline transfers"
    if term == "dp":
        if w.dp == 1:
            return "no dp communication"
        if w.zero_replicas > 1 and lo.zero_replicas == 1:
            return "less exposed dp communication (ZeRO inside a node)"
        if w.grad_compression is not None and lo.grad_compression is None:
            return f"less exposed dp communication ({w.compression_name} compression, lossy)"
        return "less exposed dp communication"
    if term == "ep":
        return "no all-to-all" if w.ep == 1 else "less all-to-all time"
    if term == "recompute":
        return "no recompute" if w.recompute == "none" else f"less recompute ({w.recompute})"
    if w.pp == 1:
        return "no stage imbalance"
    return "less compute on the busiest stage"


def fit_phrase(r: Ranked) -> str:
    """How the layout fits: its ZeRO stage and recompute, e.g. ``fits with zero 1``."""
    lay = r.layout
    extra = f" and {lay.recompute} recompute" if lay.recompute != "none" else ""
    hybrid = f" over {lay.zero_shard_size} dp ranks" if lay.zero_replicas > 1 else ""
    offload = ", the optimizer on the host" if lay.optimizer_offload else ""
    return f"fits with zero {lay.zero_stage}{hybrid}{offload}{extra}"


def reason(win: Ranked, runner_up: Ranked | None, hw: Hardware) -> str:
    """Why ``win`` ranks above ``runner_up``: the (up to two) model terms where it saves the most
    time, and how it fits, e.g. ``no bubble, tp inside a node, fits with zero 1``."""
    parts = []
    if runner_up is not None:
        a, b = win.time.terms(), runner_up.time.terms()
        tiny = 1e-6 * runner_up.time.total
        gains = sorted(((b[k] - a[k], k) for k in a), reverse=True)
        parts = [_term_phrase(k, win, runner_up, hw) for gain, k in gains[:2] if gain > tiny]
        if win.time.total >= runner_up.time.total - tiny:
            parts = ["as fast as the next"]
    return ", ".join([*parts, fit_phrase(win)])
