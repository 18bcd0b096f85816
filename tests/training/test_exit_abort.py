"""The abort at exit, reproduced on demand: a gloo worker that releases a finished op's tensors
after interpreter finalization has begun kills the process (SIGABRT), and shutting the process
groups down before returning, as ``megatronish.train`` does on every exit path, prevents it.

Each case starts two real interpreters (``megatronish/testing/late_work.py``), since the abort
happens in interpreter finalization, which forked test ranks skip.
"""

import os
import signal
import subprocess
import sys

import pytest

from megatronish.testing.multiproc import free_port
from megatronish.testing.runs import SMALL_STDLIB_RUN


def _late_work(mode: str) -> tuple[int, str]:
    """Run both ranks; rank 1's exit code and stderr."""
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "megatronish.testing.late_work", mode]
    ranks = [
        subprocess.Popen([*cmd, str(r), port], env=env, stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=90)[1] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    return ranks[1].returncode, outs[1]


@pytest.mark.slow
def test_groups_left_running_at_exit_abort_the_process():
    code, err = _late_work("left")
    assert code == -signal.SIGABRT, err
    assert "terminate called without an active exception" in err


@pytest.mark.slow
def test_groups_shut_down_before_exit_end_cleanly():
    code, err = _late_work("shutdown")
    assert code == 0, err
    assert "terminate called" not in err


SMALL = [*SMALL_STDLIB_RUN, "trainer.max_steps=4"]


@pytest.mark.slow
def test_a_profiled_torchrun_run_ends_with_its_code_and_says_why_it_skipped_finalization(
    tmp_path,
):
    """torch's profiler may keep the groups it recorded (and their threads) alive; whether it
    still does at exit depends on its timing (test_exit_paths holds that path to account on its
    own). A rank where it does ends the process itself, which cannot abort, and says why; either
    way the run ends with code 0 and every rank's trace."""
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "megatronish.train",
        *SMALL,
        "trainer.profile.steps=[2,3]",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"out_dir={tmp_path / 'out'}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "terminate called" not in r.stderr and "Fatal Python error" not in r.stderr
    for rank in (0, 1):
        assert (tmp_path / "out" / "profile" / f"rank{rank:05d}.json").exists()
        notes = [line for line in r.stderr.splitlines() if f"[rank {rank}] note: " in line]
        for line in notes:  # at most one, naming the profiler and the code
            assert "torch still holds " in line, line
            assert "profiler keeps the groups whose ops it recorded); exiting with code 0" in line
        assert len(notes) <= 1, notes
