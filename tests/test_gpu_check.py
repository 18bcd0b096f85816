"""``make gpu-check`` (tools/gpu_check.py): the smoke run on the CPU reports every section and
writes its report outside docs/; the resume comparison catches any difference; the planner
sizes the GPU model; one failing section does not stop the others."""

import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tools"))

from gpu_check.context import CheckContext  # noqa: E402
from gpu_check.flash import forced_flash_error  # noqa: E402
from gpu_check.report import FAILED, OK, SectionResult, render  # noqa: E402
from gpu_check.resume import Continuation, compare_continuation  # noqa: E402
from gpu_check.run import SECTIONS as SECTION_MODULES  # noqa: E402
from gpu_check.run import run_all  # noqa: E402
from gpu_check.sizing import choose, largest  # noqa: E402

GiB = 2**30
SECTIONS = ["throughput", "flash", "memory", "resume", "recompute"]


def test_smoke_run_reports_every_section(tmp_path):
    docs = ROOT / "docs" / "gpu.md"
    before = docs.read_bytes() if docs.exists() else None
    out = tmp_path / "report" / "gpu.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--smoke", "--out", str(out),
         "--budget-s", "60"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in SECTIONS:
        assert f"[{name}] ok in" in r.stdout or f"[{name}] not applicable in" in r.stdout, name
    assert "[flash] not applicable: flash attention is a CUDA kernel" in r.stdout
    assert "bit-identical" in r.stdout and "5 of 5 sections passed" in r.stdout
    report = out.read_text()
    assert report.startswith("# megatronish on one GPU (smoke run")
    for i in range(1, 6):
        assert f"\n## {i}. " in report
    assert "| megatronish |" in report and "| reference |" in report  # throughput rows
    assert "| peak |" in report and "| full (uniform, 1 layer) |" in report
    assert (docs.read_bytes() if docs.exists() else None) == before  # docs/gpu.md untouched


def _continuation() -> Continuation:
    g = torch.Generator().manual_seed(0)
    params = {"a.weight": torch.randn(4, 3, generator=g), "b.weight": torch.randn(5, generator=g)}
    return Continuation([2.5, 2.25, float("nan")], params)


def test_identical_continuations_compare_equal():
    a, b = _continuation(), _continuation()
    assert compare_continuation(a, b) == []  # nan losses on both sides count as equal


def test_one_ulp_in_a_loss_or_a_parameter_is_a_difference():
    a, b = _continuation(), _continuation()
    b.losses[1] = math.nextafter(b.losses[1], 3.0)
    assert compare_continuation(a, b) == [f"loss of step +2: 2.25 vs {b.losses[1]!r}"]
    b = _continuation()
    b.params["b.weight"][3] = torch.nextafter(b.params["b.weight"][3], torch.tensor(9.0))
    (problem,) = compare_continuation(a, b)
    assert problem.startswith("b.weight: max |difference|")
    b = _continuation()
    b.params["a.weight"] = b.params["a.weight"].double()
    assert "a.weight: torch.float32[4, 3] vs torch.float64[4, 3]" in compare_continuation(a, b)
    del b.params["a.weight"]
    b.losses.pop()
    problems = compare_continuation(a, b)
    assert "3 vs 2 steps" in problems and any("names differ" in p for p in problems)


def test_largest_finds_the_last_fitting_size():
    assert largest(24, lambda n: n <= 15) == 15
    assert largest(24, lambda n: True) == 24
    assert largest(24, lambda n: False) == 0


@pytest.mark.parametrize("gib", [139, 79])
def test_the_full_model_fits_an_h100_or_h200_beside_the_reference(gib):
    ctx = CheckContext(torch.device("cpu"), False, 420.0, precision="bf16")
    size = choose(ctx, gib * GiB, int(1.5 * GiB))
    assert (size.layers, size.alone_layers, size.full_layers, size.micro_batch_size) == (
        24,
    ) * 3 + (4,)
    assert size.plan.layout.precision == "bf16" and size.plan.spec.hidden_size == 2048
    assert size.overrides == ["model.num_layers=24", "trainer.micro_batch_size=4",
                              "trainer.global_batch_size=4"]  # fmt: skip


def test_a_smaller_gpu_gets_fewer_layers_and_a_tiny_one_none():
    ctx = CheckContext(torch.device("cpu"), False, 420.0, precision="bf16")
    runtime = int(1.5 * GiB)
    size = choose(ctx, 39 * GiB, runtime)
    assert 0 < size.layers < size.alone_layers <= 24  # the reference takes room
    assert size.side_by_side_bytes <= 39 * GiB
    assert choose(ctx, 45 * GiB, runtime).layers > size.layers
    with pytest.raises(RuntimeError, match="not even one layer"):
        choose(ctx, 3 * GiB, runtime)


def test_a_failing_section_fails_alone():
    def broken(ctx, out):
        out.note("starting")
        raise ValueError("boom\nsecond line")

    def fine(ctx, out):
        out.note("done")

    sections = [types.SimpleNamespace(NAME=n, TITLE=n.title(), run=f)
                for n, f in (("bad", broken), ("good", fine))]  # fmt: skip
    bad, good = run_all(CheckContext(torch.device("cpu"), True, 60.0), sections)
    assert (bad.status, good.status) == (FAILED, OK)
    assert bad.lines[-1] == "FAILED: ValueError: boom" and not bad.passed
    (late,) = run_all(CheckContext(torch.device("cpu"), True, 0.0), sections[1:])
    assert late.status == "skipped" and not late.passed
    text = render([bad, good, late], [("device", "cpu")], "1 of 3 passed", smoke=True)
    assert "| Bad | FAILED |" in text and "## 3. Good" in text
    assert [m.NAME for m in SECTION_MODULES] == SECTIONS


def test_forced_flash_reports_the_error_and_torchs_reasons():
    def unsupported():
        import warnings

        warnings.warn("Flash attention kernel not used because: reason one", stacklevel=1)
        raise RuntimeError("No available kernel. Aborting execution.\ndetails")

    assert forced_flash_error(lambda: None) == (None, [])
    error, reasons = forced_flash_error(unsupported)
    assert error == "No available kernel. Aborting execution."
    assert reasons == ["Flash attention kernel not used because: reason one"]


def test_section_result_tables_render_as_markdown(capsys):
    out = SectionResult("x", "X")
    out.table("T", ["a", "b"], [["1", "2"]])
    assert "| a | b |\n|---|---|\n| 1 | 2 |" in out.tables[0].markdown()
    assert "[x] T" in capsys.readouterr().out
