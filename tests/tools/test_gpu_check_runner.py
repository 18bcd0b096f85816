"""The GPU check's runner (tools/gpu_check.py, gpu_check/run.py) on the CPU: the report is
rewritten after every section, so a run stopped at its time limit (SIGTERM) still leaves what
it measured; ``--sections`` runs only the sections named, numbered as in the full run; an
optional comparison row that cannot run is left out without failing its section; a section is
skipped when less than its fixed (build and compile) seconds are left, and the timed repeats
get only what the fixed seconds leave."""

import importlib.util
import os
import signal
import time
import types
from pathlib import Path

import pytest
import torch
from gpu_check import run as runner
from gpu_check.context import CheckContext
from gpu_check.optional import runnable
from gpu_check.report import OK, SKIPPED, SectionResult

ROOT = Path(__file__).resolve().parents[2]


def _cli():
    spec = importlib.util.spec_from_file_location("gpu_check_cli", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(name: str, run, share: float = 0.1):
    return types.SimpleNamespace(NAME=name, TITLE=f"Section {name}", SHARE=share, run=run)


def test_the_report_is_rewritten_after_each_section(tmp_path, monkeypatch):
    report = tmp_path / "gpu.md"
    seen = {}

    def first(ctx, out):
        out.note("first measured 1.5")

    def second(ctx, out):
        seen["second"] = report.read_text() if report.exists() else ""
        raise ValueError("second broke")

    def third(ctx, out):
        seen["third"] = report.read_text() if report.exists() else ""

    fakes = (_section("one", first), _section("two", second), _section("three", third))
    monkeypatch.setattr(runner, "SECTIONS", fakes)
    code = _cli().main(["--smoke", "--out", str(report)])
    assert code == 1
    while_second = seen["second"]
    assert "| Section one | ok |" in while_second and "- first measured 1.5" in while_second
    assert "| Section two | not run | |" in while_second and "## 3. Section three" in while_second
    assert "1 of 1 sections passed so far (2 still to run)" in while_second
    assert "| Section two | FAILED |" in seen["third"]
    final = report.read_text()
    assert "| Section three | ok |" in final and "| not run |" not in final
    assert "2 of 3 sections passed in" in final
    assert not report.with_name("gpu.md.partial").exists()


def test_a_sigterm_ends_the_run_with_the_report_of_what_ran(tmp_path, monkeypatch):
    report = tmp_path / "gpu.md"

    def measured(ctx, out):
        out.note("measured")

    def killed(ctx, out):
        out.note("started")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        out.note("never reached")

    def never(ctx, out):
        raise AssertionError("ran after the stop")

    fakes = (_section("a", measured), _section("b", killed), _section("c", never))
    monkeypatch.setattr(runner, "SECTIONS", fakes)
    handler = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    assert _cli().main(["--smoke", "--out", str(report)]) == 1
    assert time.monotonic() - t0 < 4
    assert signal.getsignal(signal.SIGTERM) == handler  # restored
    text = report.read_text()
    assert "| Section a | ok |" in text and "| Section b | FAILED |" in text
    assert "- started" in text and "- FAILED: stopped after" in text and "never reached" not in text
    assert "| Section c | not run | |" in text and "## 3. Section c" in text


def test_sections_runs_the_named_ones_numbered_as_in_the_full_run(tmp_path, capsys):
    report = tmp_path / "gpu.md"
    code = _cli().main(["--smoke", "--sections", "ring_kernels,documents", "--out", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    text = report.read_text()
    assert "## 9. Packed documents" in text and "## 10. Ring attention" in text
    assert "## 1. " not in text and "Throughput" not in text
    assert "2 of 2 sections passed" in text and "sections documents,ring_kernels" in text
    # documents' optional varlen row has no CPU kernel: left out, the section still passes
    assert "[documents] varlen: left out (NotImplementedError" in out
    assert "[documents] ok in" in out


def test_unknown_sections_are_refused_before_anything_runs(capsys):
    assert _cli().main(["--smoke", "--sections", "throughput,bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown section(s) bogus: choose from throughput, flash," in err


def test_an_optional_row_that_raises_is_left_out_and_a_required_one_is_not():
    out = SectionResult("x", "X")
    calls = []

    def broken():
        raise NotImplementedError("no kernel here\nmore")

    steps = {"ours": lambda: calls.append("ours"), "theirs": broken, "fine": lambda: None}
    kept = runnable(out, steps, ["theirs", "fine", "absent"])
    assert list(kept) == ["ours", "fine"] and calls == []  # required steps not run here
    assert out.lines == ["theirs: left out (NotImplementedError: no kernel here)"]
    assert out.status == OK
    with pytest.raises(NotImplementedError):
        runnable(out, steps, [])["theirs"]()


def test_a_section_is_skipped_when_its_fixed_seconds_are_not_left():
    gpu_like = CheckContext(torch.device("cpu"), False, 200.0)  # not smoke: FIXED_S applies
    ran = []
    compiled = _section("compiled", lambda ctx, out: ran.append(1))
    (result,) = runner.run_all(gpu_like, [compiled])
    assert result.status == SKIPPED and ran == [] and not result.passed
    assert result.lines == [
        f"skipped: 200 s of the budget left, it needs about {runner.FIXED_S['compiled']} s; "
        "run it alone: --sections compiled"
    ]
    ring = _section("ring_kernels", lambda ctx, out: ran.append(1))
    (result,) = runner.run_all(gpu_like, [ring])
    assert result.status == OK and ran == [1]


def test_timed_repeats_get_what_the_fixed_seconds_leave_and_later_sections_keep_theirs():
    ctx = CheckContext(torch.device("cpu"), False, 540.0)
    ctx.plan([100.0, 200.0], [0.25, 0.25])
    ctx.reserved_s = 200.0
    assert ctx.share(0.25) == pytest.approx((540 - 300) * 0.5)
    ctx.start -= 300  # 240 s left, 200 of them for the next section's fixed part
    assert ctx.share(0.25) == pytest.approx(40, abs=1)
    ctx.plan([600.0], [0.25])
    assert ctx.share(0.25) == 0.0  # the fixed parts alone exceed the budget: minimal timings


def test_every_section_has_a_fixed_estimate():
    assert set(runner.FIXED_S) == {m.NAME for m in runner.SECTIONS}
    assert runner.select(None) == list(runner.SECTIONS)
    assert [m.NAME for m in runner.select(["compiled", "flash"])] == ["flash", "compiled"]


def test_the_time_table_of_the_page_gives_the_runners_fixed_estimates():
    from gpu_check.report import HOW_TO_RUN

    rows = [line.split("|")[1:-1] for line in HOW_TO_RUN.splitlines() if line.startswith("| ")]
    table = {cells[0].strip(): float(cells[2]) for cells in rows[1:]}
    assert table == {name: float(s) for name, s in runner.FIXED_S.items()}
    assert list(table) == [m.NAME for m in runner.SECTIONS]
