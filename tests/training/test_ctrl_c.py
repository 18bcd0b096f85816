"""Ctrl-C: the first stops after the step with a checkpoint (exit 4), a second aborts (exit 130),
never with a traceback; one while torch imports aborts in one line, where SIGTERM stops (4)."""

import os
import signal
import sys
import time

import pytest

from megatronish.testing.processes import finish, start, wait_for
from megatronish.testing.runs import SMALL_STDLIB_RUN
from megatronish.training.startup_signals import ABORTED
from megatronish.training.stop import SIGNAL, StopRequest


def test_the_first_ctrl_c_asks_for_a_stop_and_says_so(capfd):
    with StopRequest([signal.SIGINT]) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == "SIGINT" and stop.local_code() == SIGNAL
    err = capfd.readouterr().err
    assert err.count("Ctrl-C: stopping after this step with a checkpoint") == 1


def test_a_second_ctrl_c_aborts_and_a_rank_asked_to_be_quiet_is(capfd):
    with StopRequest([signal.SIGINT], notice=False):
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert "Ctrl-C" not in capfd.readouterr().err


def test_other_stop_signals_never_abort():
    with StopRequest([signal.SIGUSR2]) as stop:
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.received == "SIGUSR2"


# `python -m megatronish.train` whose `import torch` waits (up to 60 s) for RELEASE to exist,
# once it wrote MARK.
HELD_IMPORT = """
import importlib.abc, os, runpy, sys, time
class HoldTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            open(os.environ["MARK"], "w").close()
            end = time.monotonic() + 60
            while not os.path.exists(os.environ["RELEASE"]) and time.monotonic() < end:
                time.sleep(0.01)
        return None
sys.meta_path.insert(0, HoldTorch())
sys.argv = ["megatronish.train", *sys.argv[1:]]
runpy.run_module("megatronish.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)]
)
def test_a_signal_while_torch_imports_aborts_or_stops_in_one_line(tmp_path, sig):
    """Ctrl-C: one line, exit 130. SIGTERM: recorded, and the run stops once it has started,
    before training (exit 4), not killed silently."""
    mark, release, log = tmp_path / "importing", tmp_path / "release", tmp_path / "log"
    env = dict(os.environ, MARK=str(mark), RELEASE=str(release), WANDB_MODE="disabled")
    args = ["trainer.device=cpu", f"out_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path}"]
    proc = start([sys.executable, "-c", HELD_IMPORT, *args], log, env)
    deadline = time.monotonic() + 60
    while not mark.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    proc.send_signal(sig)
    time.sleep(0.2)  # the signal is handled inside the held import
    release.touch()
    code, text = finish(proc, log, timeout=120)
    if sig == signal.SIGINT:
        assert code == 130, text
        assert text.splitlines() == [ABORTED] and "aborted" in ABORTED
    else:
        assert code == 4, text
        assert text.splitlines() == [
            "stopping before training (signal SIGTERM): nothing trained, nothing to save",
            "stopped early (signal SIGTERM), exit code 4",
        ]


def test_ctrl_c_outside_training_is_one_line_and_exit_130(monkeypatch, capsys):
    import megatronish.train as entry
    from megatronish.config.compose import load_config
    from megatronish.distributed.launch import detect_launch

    def interrupted(cfg, stop, launch):
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "run", interrupted)
    cfg = load_config(["trainer.device=cpu"])
    code = entry._run_and_report(cfg, StopRequest(), detect_launch({}), "")
    assert code == entry.EXIT_ABORTED == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "aborted" in err and "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_saves_at_the_next_step_and_exits_4(tmp_path, stdlib_cache):
    log = tmp_path / "log"
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "megatronish.train",
        *SMALL_STDLIB_RUN,
        "trainer.max_steps=1000",
        f"data.cache_dir={stdlib_cache}",
        f"out_dir={tmp_path / 'run'}",
    ]
    proc = start(cmd, log, env)
    wait_for(log, r"^step\s+3/1000", proc)
    proc.send_signal(signal.SIGINT)
    code, text = finish(proc, log)
    assert code == 4, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert "Ctrl-C: stopping after this step" in text
    assert "stopped early (signal SIGINT), exit code 4" in text
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text()
    assert f"stopping after step {int(latest[5:])} (signal SIGINT); saved checkpoint" in text
