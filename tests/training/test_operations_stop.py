"""Graceful stop, in process: signal names, the deadline, the handler, ranks agreeing on a step."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from megatronish.config.compose import load_config
from megatronish.config.validate import ConfigError
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import SMALL_STDLIB_RUN, build_trainer
from megatronish.training.startup_signals import StartupSignals
from megatronish.training.stop import (
    DEADLINE,
    NO_STOP,
    SIGNAL,
    StopRequest,
    deadline_after,
    parse_signals,
)


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_parse_signals_accepts_names_with_or_without_sig_and_drops_repeats():
    assert parse_signals(["SIGTERM", "usr2", "SIGUSR2"]) == [signal.SIGTERM, signal.SIGUSR2]
    assert parse_signals([]) == []


@pytest.mark.parametrize("bad", ["SIGNOPE", "SIGKILL", "STOP"])
def test_parse_signals_names_the_bad_value_and_the_fix(bad):
    with pytest.raises(ConfigError) as e:
        parse_signals(["SIGTERM", bad])
    message = str(e.value)
    assert bad in message and "trainer.stop_signals" in message and "SIGUSR2" in message


def test_deadline_after():
    assert deadline_after(100.0, None) is None
    assert deadline_after(100.0, 2.5) == 250.0


def test_deadline_is_reached_after_exit_after_minutes_of_the_clock():
    clock = FakeClock()
    stop = StopRequest(exit_after_minutes=2, clock=clock)
    clock.now += 119.9
    assert stop.local_code() == NO_STOP
    clock.now += 0.1
    assert stop.local_code() == DEADLINE
    assert "trainer.exit_after_minutes=2 reached" in stop.describe(DEADLINE)


def test_no_deadline_and_no_signal_never_stops():
    clock = FakeClock()
    stop = StopRequest(clock=clock)
    clock.now += 1e9
    assert stop.local_code() == NO_STOP


@pytest.mark.parametrize("minutes", [0, -1.0])
def test_exit_after_minutes_must_be_positive(minutes):
    with pytest.raises(ConfigError, match="exit_after_minutes"):
        StopRequest(exit_after_minutes=minutes)


def test_the_handler_only_records_the_signal_and_is_removed_afterwards():
    before = signal.getsignal(signal.SIGUSR2)
    stop = StopRequest([signal.SIGUSR2, signal.SIGUSR1])
    with stop:
        os.kill(os.getpid(), signal.SIGUSR2)  # handled at the next bytecode, the process lives
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal keeps the first name
        assert stop.received == "SIGUSR2"
        assert stop.local_code() == SIGNAL  # a signal wins over the deadline
    assert signal.getsignal(signal.SIGUSR2) is before
    assert stop.reason is None  # nothing agreed yet: that happens at a step boundary


def test_bad_stop_signal_config_exits_2_before_anything_starts(capsys):
    from megatronish.train import EXIT_CONFIG, main_with_config

    cfg = load_config(["trainer.stop_signals=[SIGTERM,SIGBOGUS]", "trainer.device=cpu"])
    assert main_with_config(cfg) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "SIGBOGUS" in err and "Traceback" not in err


def step_clock(box: list):
    """A clock that reads one "minute" per step of the trainer put in ``box`` (0 before)."""
    return lambda: 60.0 * box[0].state.step if box else 0.0


def _stop_on_one_rank(rank, world, ckpt_dir, stop_rank, stop_after):
    """Rank ``stop_rank`` passes its deadline after step ``stop_after``; the others never do."""
    minutes = stop_after if rank == stop_rank else None
    stop = StopRequest(exit_after_minutes=minutes, clock=step_clock(box := []))
    trainer = build_trainer(
        rank, world, [f"checkpoint.dir={ckpt_dir}"], steps=20, saving=True, stop=stop
    )
    box.append(trainer)
    history = trainer.fit()
    return len(history), trainer.state.step, trainer.stop.reason


def test_ranks_agree_to_stop_after_the_same_step_and_save_it(tmp_path):
    # rank 1's deadline passes at step 3's boundary; the ranks read that a step later
    # (StopRequest.agreed_late) and all stop after step 4
    results = run_world(_stop_on_one_rank, 2, str(tmp_path), 1, 3)
    assert [r[:2] for r in results] == [(4, 4), (4, 4)]  # steps run, step reached
    assert results[0][2] == "trainer.exit_after_minutes reached on another rank"
    assert results[1][2] == "trainer.exit_after_minutes=3 reached"
    assert (tmp_path / "latest").read_text() == "step_0000004"


def _world_all_reduces(rank, world):
    """World all-reduces of a 4-step fit without and with a (never firing) stop check."""
    calls = []
    for stop in (None, StopRequest()):
        trainer = build_trainer(rank, world, [], steps=4, stop=stop)
        trainer.fit()
        calls.append(trainer.topo.stats.calls.get(("world", "all_reduce"), 0))
    return calls


def test_the_stop_check_costs_one_all_reduce_per_step():
    # steps 1-3 ask; after the last step the run ends anyway
    assert [checked - plain for plain, checked in run_world(_world_all_reduces, 2)] == [3, 3]


def test_a_stop_right_after_a_skipped_step_does_not_save_it(tmp_path):
    stop = StopRequest(exit_after_minutes=3, clock=step_clock(box := []))
    overrides = [f"checkpoint.dir={tmp_path}", "checkpoint.interval=2"]
    trainer = build_trainer(0, 1, overrides, 20, saving=True, stop=stop)
    box.append(trainer)
    inner = trainer.forward_backward

    def nan_loss_at_step_3(chunks, microbatches, **kw):
        losses = inner(chunks, microbatches, **kw)
        if trainer.state.step + 1 == 3:
            losses = [torch.full_like(x, float("nan")) for x in losses]
        return losses

    trainer.forward_backward = nan_loss_at_step_3
    trainer.fit()
    assert trainer.state.step == 3 and trainer.state.skipped_in_a_row == 1
    assert trainer.stop.reason == "trainer.exit_after_minutes=3 reached"
    assert (tmp_path / "latest").read_text() == "step_0000002"  # the skipped step 3 is not saved


@pytest.mark.parametrize("experiment", [None, "tiny", "tiny_gpt2", "tiny_3d", "moe_tiny"])
def test_the_tiny_jobs_save_every_100_steps(experiment):
    """A stop or a crash of `make train`'s job (or another tiny experiment) loses at most 100
    steps, not the whole run."""
    cfg = load_config([f"+experiment={experiment}"] if experiment else [])
    assert cfg.checkpoint.interval == 100 <= cfg.trainer.max_steps
    if experiment is None:  # the default job: saves before its last step
        assert cfg.trainer.max_steps > 2 * cfg.checkpoint.interval


# -- a stop signal during start-up ---------------------------------------------------------------
@pytest.fixture
def signals_restored():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_stop_signal_before_the_stop_request_exists_is_handed_over_to_it(signals_restored):
    startup = StartupSignals.install()  # what `python -m megatronish.train` does first
    os.kill(os.getpid(), signal.SIGTERM)  # while torch imports: recorded, the process lives
    os.kill(os.getpid(), signal.SIGUSR2)
    assert startup.received == "SIGTERM"
    stop = StopRequest([signal.SIGUSR2, signal.SIGTERM, signal.SIGINT])
    stop.take_over(startup)
    assert stop.received == "SIGTERM" and stop.local_code() == SIGNAL
    os.kill(os.getpid(), signal.SIGUSR2)  # during start-up: the request's own handler records
    assert stop.received == "SIGTERM" and startup.received == "SIGTERM"
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C keeps aborting until training starts
        os.kill(os.getpid(), signal.SIGINT)
    with stop:  # training: the first Ctrl-C only asks for a stop
        os.kill(os.getpid(), signal.SIGINT)


def test_a_start_up_signal_the_config_does_not_list_gets_its_default_action_back():
    script = """
import os, signal, sys
from megatronish.training.startup_signals import StartupSignals
startup = StartupSignals.install()
print(startup.hand_over([signal.SIGTERM]), signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL)
startup = StartupSignals.install()
os.kill(os.getpid(), signal.SIGUSR2)
print("recorded", startup.received, flush=True)
startup.hand_over([signal.SIGTERM])  # trainer.stop_signals=[SIGTERM]: SIGUSR2 ends the process
print("survived")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -signal.SIGUSR2, done.stderr
    assert done.stdout.splitlines() == ["None True", "recorded SIGUSR2"]


def test_a_stop_signal_during_start_up_stops_before_anything_is_built(
    tmp_path, capsys, signals_restored
):
    from megatronish.distributed.launch import detect_launch
    from megatronish.train import EXIT_STOPPED, main_with_config

    startup = StartupSignals()
    startup.received = "SIGTERM"  # arrived while the process imported torch
    overrides = [f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'run'}"]
    cfg = load_config([*SMALL_STDLIB_RUN, "trainer.max_steps=2", *overrides])
    assert main_with_config(cfg, detect_launch({}), startup) == EXIT_STOPPED
    out = capsys.readouterr().out
    assert "stopping before training (signal SIGTERM): nothing trained, nothing to save" in out
    assert "stopped early (signal SIGTERM), exit code 4" in out and "step " not in out
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
