"""tools/pipeline_timeline.py: the schedule it runs or simulates, and a chart of a zero-bubble
schedule's B and W ops."""

import json

import pytest

from megatronish.pipeline.simulate import analytic_bubble
from megatronish.testing.cli import load_tool, run_main


@pytest.fixture(scope="module")
def tool():
    return load_tool("pipeline_timeline")


def test_the_schedule_reaches_the_run(tool):
    args = tool.parse_args(["--pp", "4", "--vpp", "1", "--schedule", "zb-h1"])
    overrides, world = tool.job_overrides(args)
    assert "parallel.pipeline_schedule=zb-h1" in overrides and world == 4
    default = tool.job_overrides(tool.parse_args(["--pp", "2"]))[0]
    assert not any("pipeline_schedule" in o for o in default)  # vpp's default schedule


@pytest.mark.parametrize("schedule,vpp", [("zb-h1", 1), ("zbv", 2), ("1f1b", 1)])
def test_a_simulated_chart_holds_the_schedules_ops(tool, tmp_path, capfd, schedule, vpp):
    out = tmp_path / "chart"
    argv = ["--pp", "4", "--vpp", vpp, "--microbatches", "8", "--schedule", schedule]
    code, stdout, _ = run_main(tool.main, [*argv, "--simulate", "--out", out], capfd)
    assert code in (None, 0)
    events = [e for e in json.loads(out.with_suffix(".json").read_text())["traceEvents"]]
    cats = {e["cat"] for e in events if e["ph"] == "X"}
    split = schedule != "1f1b"
    assert cats == ({"fwd", "bwd_input", "bwd_weight"} if split else {"fwd", "bwd"})
    assert sum(e["name"].startswith("bwd_weight") for e in events) == (32 * vpp if split else 0)
    assert out.with_suffix(".png").stat().st_size > 5000
    f, b, w = tool.op_times([])
    analytic = analytic_bubble(4, vpp, 8, schedule, f, b + w, w)
    assert f"= {analytic:.1%}" in stdout


def test_a_schedule_that_cannot_run_the_shape_is_refused(tool, tmp_path, capfd):
    argv = ["--pp", "2", "--vpp", "2", "--schedule", "zb-h1", "--simulate", "--out", tmp_path]
    code, _, _ = run_main(tool.main, argv, capfd)
    assert "runs one chunk per stage" in str(code) and "parallel.vpp=1" in str(code)
    assert not list(tmp_path.iterdir())  # nothing written
