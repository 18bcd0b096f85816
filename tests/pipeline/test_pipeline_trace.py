"""Pipeline timelines become valid Chrome traces, Gantt charts and measured bubble fractions."""

import json
from collections import Counter

import matplotlib.axes
import matplotlib.colors
import pytest

from megatronish.pipeline.grouping import run_order, training_steps
from megatronish.pipeline.schedule import schedule_ops
from megatronish.pipeline.simulate import bubble_fraction, simulate
from megatronish.pipeline.trace import (
    PHASE_STYLE,
    busy_time,
    chrome_trace,
    gantt_png,
    measured_bubble,
    op_label,
    parse_op,
    phase_of,
    phases_in,
    simulated_timelines,
    step_span,
    write_chrome_trace,
)
from megatronish.testing.multiproc import run_world

# Two ranks of a hand-made step, in perf_counter-like seconds (origin 100 s).
SYNTHETIC = {
    0: [
        ("fwd mb0 c0", 100.0, 100.001),
        ("send_act mb0 c0", 100.001, 100.0012),
        ("recv_grad mb0 c0", 100.0012, 100.004),
        ("bwd mb0 c0", 100.004, 100.006),
    ],
    1: [
        ("recv_act mb0 c1", 100.0005, 100.0013),
        ("fwd mb0 c1", 100.0013, 100.0023),
        ("bwd mb0 c1", 100.0023, 100.0033),
        ("send_grad mb0 c1", 100.0033, 100.0035),
    ],
}


def test_parse_and_phase_of_op_names():
    assert parse_op("recv_act mb12 c3") == ("recv_act", 12, 3)
    assert parse_op("optimizer") is None
    assert [phase_of(n) for n in ("fwd mb0 c1", "bwd mb2 c0", "send_grad mb0 c1")] == [
        "fwd",
        "bwd",
        "comm",
    ]
    assert phase_of("optimizer step") == "other"
    assert [phase_of(n) for n in ("bwd_input mb1 c0", "bwd_weight mb0 c3")] == [
        "bwd_input",
        "bwd_weight",
    ]
    assert [op_label(n) for n in ("fwd mb3 c1", "bwd mb3 c1", "bwd_input mb3 c1")] == [
        "F3",
        "BW3",
        "B3",
    ]
    assert op_label("bwd_weight mb12 c0") == "W12" and op_label("send_act mb0 c0") is None


def test_chrome_trace_events_are_microseconds_with_one_thread_per_rank():
    trace = chrome_trace(SYNTHETIC)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = {
        e["tid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert meta == {0: "pp rank 0", 1: "pp rank 1"}
    assert len(spans) == 8 and {e["pid"] for e in spans} == {0}
    assert [e["name"] for e in spans if e["tid"] == 1] == [n for n, _, _ in SYNTHETIC[1]]
    first = spans[0]  # re-based to the earliest start, in microseconds
    assert first["ts"] == pytest.approx(0.0) and first["dur"] == pytest.approx(1000.0)
    recv = next(e for e in spans if e["name"] == "recv_act mb0 c1")
    assert recv["ts"] == pytest.approx(500.0) and recv["dur"] == pytest.approx(800.0)
    assert recv["cat"] == "comm" and recv["args"] == {"microbatch": 0, "chunk": 1}
    assert {e["cat"] for e in spans} == {"fwd", "bwd", "comm"}


def test_chrome_trace_json_round_trip(tmp_path):
    path = write_chrome_trace(tmp_path / "sub" / "trace.json", SYNTHETIC)
    assert json.loads(path.read_text()) == chrome_trace(SYNTHETIC)


def test_measured_bubble_on_hand_made_timeline():
    # Rank 0 computes 3 ms in its own 6 ms span: (6 - 3) / 3.
    assert measured_bubble(SYNTHETIC[0]) == pytest.approx(1.0)
    # Rank 1 computes 2 ms; its own span is 3 ms, the step's span 6 ms.
    assert measured_bubble(SYNTHETIC[1]) == pytest.approx(0.5)
    assert measured_bubble(SYNTHETIC[1], span=(100.0, 100.006)) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="fwd or bwd"):
        measured_bubble([("recv_act mb0 c1", 0.0, 1.0)])


def test_gantt_png_writes_a_png(tmp_path):
    path = gantt_png(tmp_path / "gantt.png", SYNTHETIC, "synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


class _Drawn:
    """What the chart draws: bar colours and texts (``Axes.barh`` and ``Axes.text`` recorded)."""

    def __init__(self, monkeypatch):
        self.colors, self.texts = [], []
        barh, text = matplotlib.axes.Axes.barh, matplotlib.axes.Axes.text

        def record_barh(ax, y, width, *args, **kwargs):
            self.colors.append(matplotlib.colors.to_rgba(kwargs["color"]))
            return barh(ax, y, width, *args, **kwargs)

        def record_text(ax, x, y, s, *args, **kwargs):
            self.texts.append(s)
            return text(ax, x, y, s, *args, **kwargs)

        monkeypatch.setattr(matplotlib.axes.Axes, "barh", record_barh)
        monkeypatch.setattr(matplotlib.axes.Axes, "text", record_text)


def test_a_zb_h1_chart_draws_b_and_w_apart_from_f_and_whole_backwards(tmp_path, monkeypatch):
    sim = simulate(4, 1, 8, 1.0, 2.0, schedule="zb-h1", weight_time=0.8)
    timelines = simulated_timelines(sim)
    assert phases_in(timelines) == ["fwd", "bwd_input", "bwd_weight"]
    assert [n for n, _, _ in timelines[3][:3]] == ["fwd mb0 c3", "bwd_input mb0 c3", "fwd mb1 c3"]
    span = step_span(timelines)  # the simulation's bubble, from its timelines
    assert measured_bubble(timelines[0], span) == pytest.approx(bubble_fraction(sim, 0))
    assert busy_time(timelines[0]) == pytest.approx(sim.busy_time[0] * 1e-3)
    styles = [PHASE_STYLE[k][:2] for k in ("fwd", "bwd", "bwd_input", "bwd_weight")]
    assert len({letter for letter, _ in styles}) == len({cmap for _, cmap in styles}) == 4
    drawn = _Drawn(monkeypatch)
    assert gantt_png(tmp_path / "zb.png", timelines, "zb-h1").stat().st_size > 5000
    for mb in range(8):
        assert {f"F{mb}", f"B{mb}", f"W{mb}"} <= set(drawn.texts)
    assert not any(t.startswith("BW") for t in drawn.texts)
    zb_colors = set(drawn.colors)

    drawn = _Drawn(monkeypatch)
    plain = simulated_timelines(simulate(4, 1, 8, 1.0, 2.0))
    assert phases_in(plain) == ["fwd", "bwd"]
    gantt_png(tmp_path / "1f1b.png", plain, "1f1b")
    assert "BW0" in drawn.texts and "B0" not in drawn.texts and "W0" not in drawn.texts
    f_colors = {c for c in drawn.colors if c in zb_colors}  # the forwards (and grey p2p)
    assert len(zb_colors - f_colors) == 2 and len(set(drawn.colors) - f_colors) == 1


def _record_step(rank, world, extra=("parallel.vpp=2",)):
    from megatronish.pipeline.engine import Timeline
    from megatronish.testing.runs import build_trainer

    trainer = build_trainer(rank, world, ["parallel.pp=2", *extra], steps=1)
    trainer.timeline = timeline = Timeline()
    trainer.train_step()
    events = sorted(timeline.events, key=lambda e: e[1])  # a group's events land as it is waited
    return [(n, s + timeline.origin, e + timeline.origin) for n, s, e in events]


def test_real_pp2_vpp2_step_records_every_schedule_op(tmp_path):
    timelines = dict(enumerate(run_world(_record_step, 2)))
    for rank, events in timelines.items():
        ops = run_order(training_steps(2, 2, 4, rank))  # the schedule's ops as they run
        assert Counter(ops) == Counter(schedule_ops(2, 2, 4, rank))
        assert [n for n, _, _ in events] == [
            f"{op.kind} mb{op.microbatch} c{op.chunk}" for op in ops
        ]
        assert all(end >= start for _, start, end in events)
        assert measured_bubble(events) >= 0
    trace = chrome_trace(timelines)
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert gantt_png(tmp_path / "real.png", timelines, "pp=2 vpp=2").stat().st_size > 5000


def test_real_zb_h1_step_records_b_and_w_and_draws_them(tmp_path, monkeypatch):
    extra = ["parallel.vpp=1", "parallel.pipeline_schedule=zb-h1"]
    timelines = dict(enumerate(run_world(_record_step, 2, extra)))
    for rank, events in timelines.items():
        ops = [
            f"{op.kind} mb{op.microbatch} c{op.chunk}"
            for op in schedule_ops(2, 1, 4, rank, "zb-h1")
        ]
        names = [n for n, _, _ in events]
        assert Counter(names) == Counter(ops)  # W runs while a group is in flight: its place
        computes = [n for n in names if phase_of(n) != "comm"]  # among transfers may differ
        assert computes == [n for n in ops if phase_of(n) != "comm"]
        assert busy_time(events) > sum(e - s for n, s, e in events if phase_of(n) == "fwd")
        assert measured_bubble(events, step_span(timelines)) >= 0
    trace = chrome_trace(timelines)
    cats = {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert cats == {"fwd", "bwd_input", "bwd_weight", "comm"}
    drawn = _Drawn(monkeypatch)
    assert gantt_png(tmp_path / "zb.png", timelines, "zb-h1").stat().st_size > 5000
    assert {"F0", "B0", "W0"} <= set(drawn.texts)
