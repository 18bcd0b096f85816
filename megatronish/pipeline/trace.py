"""Pipeline timelines as Chrome/Perfetto traces, Gantt charts and measured bubble fractions.

Input is what :class:`megatronish.pipeline.engine.Timeline` records, one list per pipeline rank:
``{pp_rank: [(name, start_s, end_s), ...]}`` with names like ``"fwd mb3 c1"``, ``"bwd mb3 c1"``
(a whole backward), ``"bwd_input mb3 c1"`` and ``"bwd_weight mb3 c1"`` (the zero-bubble
schedules' B and W) or ``"recv_act mb0 c2"``; :func:`simulated_timelines` makes the same from a
:func:`~megatronish.pipeline.simulate.simulate` run. Times may be relative to any origin shared
by the ranks (for example raw ``time.perf_counter()`` values, which are comparable across
processes of one machine): every output here is re-based so the earliest event of all ranks
starts at 0.

Pure Python (matplotlib only inside :func:`gantt_png`), so tests drive it without processes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from megatronish.pipeline.ops import COMPUTE_KINDS
from megatronish.pipeline.simulate import Simulation

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Event = tuple[str, float, float]
Timelines = dict[int, list[Event]]

_OP = re.compile(r"^(?P<kind>[a-z_]+) mb(?P<mb>\d+) c(?P<chunk>\d+)$")
COMPUTE = COMPUTE_KINDS  # fwd, bwd (whole), bwd_input (B), bwd_weight (W)
BACKWARD = ("bwd", "bwd_input", "bwd_weight")
# How the chart draws each compute phase: its label letter, colour map and legend words.
PHASE_STYLE = {
    "fwd": ("F", "Blues", "forward"),
    "bwd": ("BW", "Oranges", "backward (B and W at once)"),
    "bwd_input": ("B", "Purples", "B: input grad"),
    "bwd_weight": ("W", "Greens", "W: weight grads"),
}


def parse_op(name: str) -> tuple[str, int, int] | None:
    """``"fwd mb3 c1"`` -> ``("fwd", 3, 1)``; None for a name that is not a pipeline op."""
    m = _OP.match(name)
    return (m["kind"], int(m["mb"]), int(m["chunk"])) if m else None


def phase_of(name: str) -> str:
    """The category of an op: its compute kind ("fwd", "bwd", "bwd_input", "bwd_weight"),
    "comm" (sends and receives) or "other"."""
    parsed = parse_op(name)
    kind = parsed[0] if parsed else name.split(" ", 1)[0]
    if kind in COMPUTE:
        return kind
    if kind.startswith(("send", "recv")):
        return "comm"
    return "other"


def origin_of(timelines: Timelines) -> float:
    """The earliest start over every rank (0.0 when there are no events)."""
    starts = [start for events in timelines.values() for _, start, _ in events]
    return min(starts, default=0.0)


def phase_time(events: list[Event], *phases: str) -> float:
    """Seconds a rank spent in ops of the given phases (see :func:`phase_of`; a zero-bubble
    schedule's backward is ``*BACKWARD``)."""
    return sum(end - start for name, start, end in events if phase_of(name) in phases)


def busy_time(events: list[Event]) -> float:
    """Seconds a rank spent computing (forward and backward ops, B and W included)."""
    return phase_time(events, *COMPUTE)


def measured_bubble(events: list[Event], span: tuple[float, float] | None = None) -> float:
    """``(span - busy compute) / busy compute`` of one rank's events.

    ``span`` defaults to the rank's own first start to last end; pass the step's ``(start, end)``
    over all ranks to get the paper's definition (the optimizer waits for the slowest rank), which
    :func:`megatronish.pipeline.simulate.bubble_fraction` uses for simulated schedules. Time in
    sends and receives, including waiting for a peer, counts as bubble.
    """
    busy = busy_time(events)
    if busy <= 0:
        raise ValueError(
            "measured_bubble needs at least one fwd or bwd (or bwd_input, bwd_weight) event "
            "with a duration."
        )
    if span is None:
        span = (min(s for _, s, _ in events), max(e for _, _, e in events))
    return (span[1] - span[0] - busy) / busy


def step_span(timelines: Timelines) -> tuple[float, float]:
    """``(first start, last end)`` over every rank: the span of the recorded step."""
    ends = [end for events in timelines.values() for _, _, end in events]
    return origin_of(timelines), max(ends, default=0.0)


def simulated_timelines(sim: Simulation, seconds_per_unit: float = 1e-3) -> Timelines:
    """The compute ops of a :func:`~megatronish.pipeline.simulate.simulate` run as timelines
    (its time units as ``seconds_per_unit`` each; the simulation's sends take no time)."""
    return {
        rank: [
            (
                f"{op.kind} mb{op.microbatch} c{op.chunk}",
                start * seconds_per_unit,
                end * seconds_per_unit,
            )
            for op, start, end in ops
        ]
        for rank, ops in sim.timeline.items()
    }


def chrome_trace(timelines: Timelines, process_name: str = "pipeline") -> dict:
    """A Chrome trace (``chrome://tracing``, https://ui.perfetto.dev) of the pipeline ranks.

    One complete event (``ph: "X"``, ``ts``/``dur`` in microseconds) per op, on thread ``tid`` =
    pipeline rank of process 0, named as recorded, with category fwd / bwd / bwd_input /
    bwd_weight / comm and the microbatch and chunk as ``args``; metadata events name the
    threads "pp rank N".
    """
    origin = origin_of(timelines)
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": process_name}}
    ]
    for rank in sorted(timelines):
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"pp rank {rank}"},
            }
        )
        events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": 0,
                "tid": rank,
                "args": {"sort_index": rank},
            }
        )
        for name, start, end in timelines[rank]:
            parsed = parse_op(name)
            args = {"microbatch": parsed[1], "chunk": parsed[2]} if parsed else {}
            events.append(
                {
                    "name": name,
                    "cat": phase_of(name),
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": (start - origin) * 1e6,
                    "dur": max(end - start, 0.0) * 1e6,
                    "args": args,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, timelines: Timelines) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(timelines)) + "\n")
    return path


def _stages(events: list[Event]) -> tuple[float, float] | None:
    """End of warm-up (first backward starts) and start of cool-down (last forward ends)."""
    fwd_ends = [e for n, _, e in events if phase_of(n) == "fwd"]
    bwd_starts = [s for n, s, _ in events if phase_of(n) in ("bwd", "bwd_input")]
    if not fwd_ends or not bwd_starts:
        return None
    return min(bwd_starts), max(fwd_ends)


def op_label(name: str) -> str | None:
    """The text inside a compute bar: its phase's letter and the microbatch (``F3``, ``BW3`` for
    a whole backward, ``B3`` and ``W3`` for a zero-bubble schedule's B and W); None for other
    ops."""
    parsed = parse_op(name)
    if parsed is None or parsed[0] not in PHASE_STYLE:
        return None
    return f"{PHASE_STYLE[parsed[0]][0]}{parsed[1]}"


def phases_in(timelines: Timelines) -> list[str]:
    """The compute phases the timelines hold, in :data:`COMPUTE` order."""
    seen = {phase_of(n) for events in timelines.values() for n, _, _ in events}
    return [p for p in COMPUTE if p in seen]


def _draw_ops(
    ax: Axes, y: float, events: list[Event], origin: float, color: Callable, min_label_ms: float
) -> None:
    """One rank's compute bars (labelled by :func:`op_label`) and thin communication bars."""
    for name, start, end in events:
        x0, width = (start - origin) * 1e3, (end - start) * 1e3
        parsed, phase = parse_op(name), phase_of(name)
        if phase == "comm":
            ax.barh(y - 0.36, width, left=x0, height=0.08, color="0.55")
        elif phase in COMPUTE:
            chunk = parsed[2] if parsed else 0
            ax.barh(
                y,
                width,
                left=x0,
                height=0.6,
                color=color(phase, chunk),
                edgecolor="white",
                linewidth=0.5,
            )
            label = op_label(name)
            if label and width > min_label_ms:
                ax.text(x0 + width / 2, y, label, ha="center", va="center", fontsize=7)


def _draw_stages(ax: Axes, y: float, events: list[Event], origin: float, steady: str) -> None:
    """Brackets above a rank's row: warm-up, the steady state (``steady``), cool-down."""
    stages = _stages(events)
    if stages is None:
        return
    marks = [min(s for _, s, _ in events), *stages, max(e for _, _, e in events)]
    marks = [(m - origin) * 1e3 for m in marks]
    for a, b, text in zip(marks, marks[1:], ("warm-up", steady, "cool-down")):
        if b > a:
            ax.plot([a, a, b, b], [y + 0.34, y + 0.38, y + 0.38, y + 0.34], color="0.3", lw=0.8)
            ax.text((a + b) / 2, y + 0.40, text, ha="center", va="bottom", fontsize=7)


def gantt_png(path: str | Path, timelines: Timelines, title: str = "") -> Path:
    """Draw one row per pipeline rank: forward, backward and communication bars over time.

    Forward ops are blue (``F``), whole backward ops orange (``BW``), a zero-bubble schedule's
    B purple (``B``, the input grad) and W green (``W``, the weight grads), a darker shade for
    each later virtual chunk (chunk // number of ranks), with the microbatch written inside;
    sends and receives are thin grey bars under the row (a long one is a rank waiting on its
    peer); white is idle. Brackets above each row mark warm-up, the steady state and cool-down,
    and the right margin gives the rank's measured bubble over the step span.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ranks = sorted(timelines)
    pp = max(len(ranks), 1)
    origin, span = origin_of(timelines), step_span(timelines)
    total_ms = (span[1] - span[0]) * 1e3
    chunks = [p[2] for ev in timelines.values() for n, _, _ in ev if (p := parse_op(n))]
    vpp = max(chunks, default=0) // pp + 1
    maps = {phase: plt.get_cmap(style[1]) for phase, style in PHASE_STYLE.items()}
    shade = lambda v: 0.45 + 0.4 * (v / max(vpp - 1, 1))
    color = lambda phase, chunk: maps[phase](shade(chunk // pp))
    phases = phases_in(timelines)
    steady = "1F1B" if "bwd" in phases or not phases else "F, B, W"

    fig, ax = plt.subplots(figsize=(14, 1.0 + 1.2 * len(ranks)), dpi=110)
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row  # rank 0 on top
        _draw_ops(ax, y, timelines[rank], origin, color, min_label_ms=total_ms / 120)
        _draw_stages(ax, y, timelines[rank], origin, steady)
        if busy_time(timelines[rank]) > 0:
            bubble = measured_bubble(timelines[rank], span)
            ax.text(total_ms * 1.005, y, f"bubble\n{bubble:.1%}", va="center", fontsize=8)
    ax.set_yticks(range(len(ranks)), [f"pp rank {r}" for r in reversed(ranks)])
    ax.set_ylim(-0.6, len(ranks) - 0.35)
    ax.set_xlim(0, total_ms * 1.06 if total_ms > 0 else 1)
    ax.set_xlabel("time since the step started (ms)")
    ax.set_title(title)
    handles = [
        Patch(color=maps[k](shade(v)), label=f"{PHASE_STYLE[k][2]}, virtual chunk {v}")
        for k in phases
        for v in range(vpp)
    ]
    handles += [
        Patch(color="0.55", label="send / recv (incl. waiting)"),
        Patch(facecolor="white", edgecolor="0.6", label="idle"),
    ]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18 - 0.1 / pp),
        ncol=min(len(handles), 6),
        fontsize=8,
        frameon=False,
    )
    ax.grid(axis="x", color="0.9", linewidth=0.5)
    ax.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
