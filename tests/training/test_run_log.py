"""What a run logs: the step line (global and per-device tok/s, ETA), the log file with
timestamps, the progress bar, and the start-up summary (parameters, planned memory, epochs)."""

import io
import re

import pytest

from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.testing import runs
from megatronish.training import startup
from megatronish.training.progress import ProgressLogger, fmt_bytes, fmt_duration, format_step

STEP = {
    "step": 10,
    "loss": 5.0,
    "lr": 1e-3,
    "grad_norm": 1.0,
    "tokens_per_s": 8000.0,
    "step_time_s": 0.5,
    "peak_memory": 0,
    "skipped_steps": 0,
}


@pytest.mark.parametrize(
    "seconds, text",
    [(12.4, "12s"), (247, "4m07s"), (7500, "2h05m"), (3 * 86400 + 4 * 3600, "3d04h")],
)
def test_durations_read_at_a_glance(seconds, text):
    assert fmt_duration(seconds) == text


def test_the_step_line_says_global_and_per_device_throughput_and_the_eta():
    line = format_step({**STEP, "tokens_per_s_per_device": 1000.0}, max_steps=130)
    assert "8,000 tok/s (1,000 tok/s/dev)" in line
    assert line.endswith("ETA 1m00s")  # 120 steps left at 0.5 s
    one_device = format_step({**STEP, "tokens_per_s_per_device": 8000.0}, max_steps=10)
    assert "8,000 tok/s |" in one_device and "/dev" not in one_device
    assert "ETA" not in one_device  # the last step


def test_the_log_file_has_every_logged_line_with_its_time_and_appends(tmp_path):
    path = tmp_path / "run" / "train.log"
    cfg = runs.test_config([f"logging.log_file={path}"], 4)
    for _ in range(2):  # a resume appends
        logger = ProgressLogger(cfg, enabled=True, run_dir=str(tmp_path), run_id="tiny-1234")
        logger.info("model: two\nlines")
        logger.log_step({**STEP, "step": 2})
        logger.log_eval(2, 4.5)
        logger.close()
    lines = path.read_text().splitlines()
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
    assert all(re.match(stamp, ln) for ln in lines), lines
    text = [re.sub(stamp, "", ln) for ln in lines]
    assert re.fullmatch(r"=== start of run tiny-1234 \(pid \d+\) ===", text[0])
    assert text[1:3] == ["model: two", "lines"]
    assert text[3].startswith("step      2/4 | loss 5.0000") and text[4].startswith("eval")
    assert len(text) == 10 and text[5].startswith("=== start of run tiny-1234")


def test_a_logger_that_does_not_log_writes_no_file(tmp_path):
    cfg = runs.test_config([f"logging.log_file={tmp_path / 'x.log'}"], 4)
    ProgressLogger(cfg, enabled=False, run_dir=str(tmp_path)).info("hello")
    assert not (tmp_path / "x.log").exists()


def test_the_progress_bar_follows_the_logged_steps_and_lines_go_above_it(capsys):
    cfg = runs.test_config(["logging.progress_bar=true"], 40)
    bar = io.StringIO()
    logger = ProgressLogger(cfg, enabled=True, run_dir=".", bar_file=bar)
    logger.log_step({**STEP, "step": 10})
    assert logger.bar.n == 10
    logger.log_step({**STEP, "step": 30})
    assert logger.bar.n == 30 and "30/40" in bar.getvalue() and "loss=5.0000" in bar.getvalue()
    logger.close()
    assert "step     30/40" in capsys.readouterr().out  # through tqdm.write: above the bar
    assert "step " not in bar.getvalue()


def test_without_a_terminal_the_bar_stays_away(capsys, monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal, as in a SLURM job
    logger = ProgressLogger(runs.test_config(["logging.progress_bar=true"], 40), True, ".")
    assert logger.bar.disable
    logger.log_step({**STEP, "step": 10})
    assert "step     10/40" in capsys.readouterr().out
    logger.close()


def test_the_startup_summary_agrees_with_the_planner():
    cfg = runs.test_config(
        [
            "parallel.tp=2",
            "parallel.sp=true",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=2",
        ],
        4,
    )
    plan = startup.planned(cfg, 4, 512, "cuda")  # the device the run got, not trainer.device
    assert layout_from_config(cfg, 4).device_type == "cpu"
    assert plan.layout.device_type == "cuda" and plan.layout.tp == 2 and plan.layout.dp == 2
    line = startup.model_line(plan, "llama", 1234)
    assert f"{plan.parameters:,} parameters" in line and "this rank's chunks: 1,234" in line
    assert plan.parameters == make_plan(spec_of(cfg, 512), plan.layout).parameters > 0
    (stage,) = plan.stages
    memory = startup.memory_line(plan)
    assert memory.startswith(f"planned peak memory per rank: {fmt_bytes(stage.peak)} = ")
    assert f"{fmt_bytes(stage.states.optimizer)} optimizer" in memory and "stage" not in memory
    pp = startup.planned(runs.test_config(["parallel.pp=2"], 4), 2, 512, "cpu")
    assert "(pipeline stage " in startup.memory_line(pp)


def test_the_epochs_line_says_how_often_each_sample_is_read():
    assert startup.epochs_line("train", 1000, 500) == (
        "data: train 1,000 samples per epoch, the run reads 500 (0.5 epochs)"
    )
    assert "every sample read 4.0 times" in startup.epochs_line("train", 1000, 4000)


def test_the_throughput_note_names_global_and_per_device():
    assert "global (all 8 ranks)" in startup.throughput_note(8)
    assert "one device" in startup.throughput_note(1)
    assert "fp8" not in startup.throughput_note(8)
    assert "against the device's fp8 peak" in startup.throughput_note(8, "tensorwise")


@pytest.mark.slow
def test_a_log_file_that_cannot_be_written_stops_the_run_in_one_line(tmp_path, stdlib_cache):
    import os
    import subprocess
    import sys

    from megatronish.testing.runs import SMALL_STDLIB_RUN

    (tmp_path / "file").write_text("")
    log = tmp_path / "file" / "train.log"  # its directory is a file
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "megatronish.train",
        *SMALL_STDLIB_RUN,
        "trainer.max_steps=2",
        f"data.cache_dir={stdlib_cache}",
        f"out_dir={tmp_path / 'run'}",
        f"logging.log_file={log}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert f"cannot write logging.log_file={log}" in r.stderr and "null" in r.stderr
