"""The launch scripts without training: which interpreter they run, the job's port and CPUs, and
what their exit codes mean to SLURM, with a stand-in 'python' that records how it was started.

The stand-in runs the launchers' probes (``python -c``) on the real interpreter; as torchrun
(scripts/lib/quiet_torchrun.py) it starts ``--nproc-per-node`` workers and exits 1 when one
fails (torchrun's code), or runs the real one when ``REAL_TORCHRUN=1``; as
``megatronish.train`` it records its environment and exits ``TRAIN_EXIT``, or waits for SIGTERM
or SIGUSR2 and then exits 4 (``TRAIN_STOP_EXIT`` after SIGTERM) when ``TRAIN_WAIT_FOR_TERM=1``;
as ``megatronish.generate`` it records that it ran (``make train`` runs it as ``PY``).
"""

import importlib.util
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatronish.testing.fake_slurm import fake_slurm_env
from megatronish.testing.processes import finish, start, wait_for

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "scripts" / "lib"
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
STAND_IN = f"""#!/usr/bin/env bash
if [[ $1 == -c ]]; then exec {sys.executable} "$@"; fi
if [[ $1 == */scripts/lib/quiet_torchrun.py ]]; then
  echo "torchrun ${{*:2}}" >> "$SEEN"
  if [[ ${{REAL_TORCHRUN:-}} == 1 ]]; then exec {sys.executable} "$@"; fi
  shift
  n=1
  while (($#)) && [[ $1 != --no-python ]]; do
    if [[ $1 == --nproc-per-node ]]; then n=$2; fi
    shift
  done
  shift
  pids=()
  for ((r = 0; r < n; r++)); do
    RANK=$r LOCAL_RANK=$r "$@" &
    pids+=($!)
  done
  failed=0
  for pid in "${{pids[@]}}"; do wait "$pid" || failed=1; done
  exit $failed
fi
if [[ $1 == -m && $2 == megatronish.train ]]; then
  echo "train MASTER_PORT=${{MASTER_PORT-}} CPUS=${{SLURM_CPUS_PER_TASK-}} ${{*:3}}" >> "$SEEN"
  if [[ ${{TRAIN_WAIT_FOR_TERM:-}} == 1 ]]; then
    trap 'echo "train got TERM" >> "$SEEN"; exit ${{TRAIN_STOP_EXIT:-4}}' TERM
    trap 'echo "train got USR2" >> "$SEEN"; exit 4' USR2
    echo "train ready" >> "$SEEN"
    while :; do sleep 0.05; done
  fi
  exit "${{TRAIN_EXIT:-0}}"
fi
if [[ $1 == -m && $2 == megatronish.generate ]]; then
  echo "generate ${{*:3}}" >> "$SEEN"
  exit 0
fi
echo "stand-in python: unexpected arguments $*" >&2
exit 99
"""


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def clean_env(**extra) -> dict[str, str]:
    """This environment without an interpreter choice, SLURM or torchrun variables."""
    drop = ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX", "RDZV_PORT", "REQUEUE", "MEGATRONISH_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", *drop))}
    return {**env, **extra}


@pytest.fixture
def stand_in(tmp_path) -> Path:
    return executable(tmp_path / "env" / "bin" / "python", STAND_IN)


def seen(tmp_path: Path) -> list[str]:
    path = tmp_path / "seen"
    return path.read_text().splitlines() if path.exists() else []


def trains(tmp_path: Path) -> list[str]:
    return [line for line in seen(tmp_path) if line.startswith("train ")]


# -- the interpreter ----------------------------------------------------------------------------
def launcher_python(repo: Path, **env) -> str:
    script = 'source "$0"; launcher_python "$1"'
    done = subprocess.run(
        ["bash", "-c", script, str(LIB / "python.sh"), str(repo)],
        env=clean_env(**env),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_interpreter_is_python_else_the_active_environment_else_dot_venv_else_python3(
    tmp_path,
):
    venv = executable(tmp_path / "venv" / "bin" / "python", "")
    conda = executable(tmp_path / "conda" / "bin" / "python", "")
    repo = tmp_path / "repo"
    dot_venv = executable(repo / ".venv" / "bin" / "python", "")
    bare = tmp_path / "bare"
    bare.mkdir()
    assert launcher_python(bare) == "python3"
    assert launcher_python(repo) == str(dot_venv)
    assert launcher_python(repo, VIRTUAL_ENV=str(venv.parents[1])) == str(venv)
    assert launcher_python(repo, CONDA_PREFIX=str(conda.parents[1])) == str(conda)
    both = {"VIRTUAL_ENV": str(venv.parents[1]), "CONDA_PREFIX": str(conda.parents[1])}
    assert launcher_python(bare, **both) == str(venv)
    assert launcher_python(repo, PYTHON="/opt/py/bin/python3", **both) == "/opt/py/bin/python3"
    # an environment variable left over from a deleted environment is passed over
    assert launcher_python(repo, VIRTUAL_ENV=str(tmp_path / "gone")) == str(dot_venv)


def test_launch_local_runs_the_active_virtualenvs_python(tmp_path, stand_in):
    env = clean_env(VIRTUAL_ENV=str(stand_in.parents[1]), SEEN=str(tmp_path / "seen"))
    done = subprocess.run(
        ["bash", str(REPO / "scripts/launch_local.sh"), "2", "a=1"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert trains(tmp_path) == ["train MASTER_PORT= CPUS= a=1"] * 2


@pytest.mark.parametrize("script", ["scripts/launch_local.sh", "scripts/slurm/train.sbatch"])
def test_an_interpreter_without_torch_is_refused_in_one_line_naming_python(tmp_path, script):
    no_site = executable(tmp_path / "no_site", f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    env = fake_slurm_env(tmp_path / "slurm", submit_dir=str(REPO))
    for python, says in ((no_site, "cannot import torch"), (tmp_path / "nothing", "cannot run")):
        env = clean_env(
            **{k: v for k, v in env.items() if k.startswith("SLURM_")},
            PATH=env["PATH"],
            PYTHON=str(python),
        )
        done = subprocess.run(
            ["bash", str(REPO / script), "2"], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "PYTHON=" in lines[0], done.stderr


# -- exit codes through torchrun ----------------------------------------------------------------
def workers_exit_code(tmp_path: Path, torchrun_code: int, codes: dict[str, str]) -> int:
    codes_dir = tmp_path / f"codes{len(list(tmp_path.iterdir()))}"
    codes_dir.mkdir()
    for rank, code in codes.items():
        (codes_dir / rank).write_text(code + "\n")
    script = 'source "$0"; workers_exit_code "$1" "$2"'
    done = subprocess.run(
        ["bash", "-c", script, str(LIB / "torchrun.sh"), str(codes_dir), str(torchrun_code)],
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def test_a_torchrun_launch_exits_with_its_workers_code(tmp_path):
    assert workers_exit_code(tmp_path, 1, {"0": "4", "1": "4"}) == 4  # a graceful stop
    assert workers_exit_code(tmp_path, 1, {"0": "7", "1": "7"}) == 7  # already complete
    assert workers_exit_code(tmp_path, 1, {"0": "3", "1": "6"}) == 6  # the highest, as srun
    assert workers_exit_code(tmp_path, 0, {"0": "4"}) == 0  # torchrun says all done
    # a worker SIGKILLed with its wrapper, or none started: torchrun's own code
    assert workers_exit_code(tmp_path, 1, {"0": "4", "1": "running"}) == 1
    assert workers_exit_code(tmp_path, 1, {}) == 1


@pytest.mark.parametrize("code,real", [(3, False), (4, True), (7, False)])
def test_launch_local_exits_with_the_trainers_code_not_torchruns(tmp_path, stand_in, code, real):
    """A stop (4) through the real torchrun: the workers' lines and the script's one line, no
    torchrun traceback or summary (quiet_torchrun.py; its other cases are tested in process)."""
    env = clean_env(PYTHON=str(stand_in), SEEN=str(tmp_path / "seen"), TRAIN_EXIT=str(code))
    if real:
        env["REAL_TORCHRUN"] = "1"
    done = subprocess.run(
        ["bash", str(REPO / "scripts/launch_local.sh"), "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stderr
    assert f"torchrun exited with 1, its workers with {code}" in done.stderr
    assert len(trains(tmp_path)) == 2
    if real:
        assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
        assert f"failed (exitcode: {code})" not in done.stderr, done.stderr


def quiet_torchrun():
    spec = importlib.util.spec_from_file_location("quiet_torchrun", LIB / "quiet_torchrun.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def failed_workers(*codes: int):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {r: ProcessFailure(r, 100 + r, c, "<N/A>") for r, c in enumerate(codes)}
    return ChildFailedError("bash", failures)


def test_quiet_torchrun_ends_a_signal_or_graceful_workers_without_a_traceback(capfd):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from megatronish.train import EXIT_COMPLETE, EXIT_STOPPED

    quiet = quiet_torchrun()
    assert quiet.GRACEFUL_CODES == (EXIT_STOPPED, EXIT_COMPLETE)

    def torchrun_raising(error):
        def torchrun(argv):
            assert argv == ["--standalone"]
            raise error

        return torchrun

    for error in (SignalException("got 15", signal.SIGTERM), failed_workers(4, 7, 4)):
        assert quiet.run(["--standalone"], torchrun_raising(error)) == 1
    assert quiet.run(["--standalone"], lambda argv: None) == 0
    for codes in ((4, 6), (1,), (137, 4)):  # a failure keeps torchrun's report
        with pytest.raises(type(failed_workers(1))):
            quiet.run(["--standalone"], torchrun_raising(failed_workers(*codes)))
    assert capfd.readouterr() == ("", "")
    # torchrun's "failed" line: dropped for a graceful code only
    keep = quiet._GracefulWorkers().filter
    record = logging.LogRecord(
        "x", logging.ERROR, "api.py", 1, quiet.FAILED_WORKER + " r", (4, 0), None
    )
    assert not keep(record)
    record.args = (6, 0)
    assert keep(record)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2])
def test_a_stop_signal_to_launch_local_reaches_real_torchruns_workers_and_their_code_returns(
    tmp_path, stand_in, sig
):
    env = clean_env(
        PYTHON=str(stand_in),
        SEEN=str(tmp_path / "seen"),
        REAL_TORCHRUN="1",
        TRAIN_WAIT_FOR_TERM="1",
    )
    log = tmp_path / "log"
    proc = start(["bash", str(REPO / "scripts/launch_local.sh"), "2"], log, env)
    wait_for(tmp_path / "seen", r"(?s)train ready.*train ready", proc)
    proc.send_signal(sig)  # launch_local.sh -> torchrun -> each worker, once
    code, text = finish(proc, log)
    assert code == 4, text[-2000:]
    assert seen(tmp_path).count(f"train got {sig.name[3:]}") == 2, seen(tmp_path)
    assert "torchrun exited with 1, its workers with 4: exiting with 4" in text
    assert "Traceback" not in text and "SignalException" not in text, text[-2000:]


# -- make train ---------------------------------------------------------------------------------
def make_train_env(tmp_path: Path, **extra) -> tuple[list[str], dict[str, str]]:
    """``make train`` with the stand-in as its PY, an install stamp of its own (no install)."""
    venv = tmp_path / "venv"
    venv.mkdir(exist_ok=True)
    (venv / ".megatronish-installed").touch()
    env = clean_env(SEEN=str(tmp_path / "seen"), **extra)
    env = {k: v for k, v in env.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    python = tmp_path / "env" / "bin" / "python"
    return ["make", "train", f"VENV={venv}", f"PY={python}", "ARGS=a=1"], env


@pytest.mark.parametrize("train_exit,make_exit", [(0, 0), (7, 0), (4, 0), (3, 2)])
def test_make_train_samples_a_finished_run_ends_a_stopped_one_in_one_line_and_fails_a_failure(
    tmp_path, stand_in, train_exit, make_exit
):
    """0 and 7 (already complete) sample; 4 (a graceful stop: a signal to the trainer,
    ``trainer.exit_after_minutes``) is one line, no sample, and no ``Error 1`` (make's exit 2);
    a failure is make's error. (A Ctrl-C in the terminal also reaches make, which then ends
    with its own ``Interrupt`` once the trainer has saved: GNU make's handling of SIGINT.)"""
    cmd, env = make_train_env(tmp_path, TRAIN_EXIT=str(train_exit))
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == make_exit, done.stdout + done.stderr
    sampled = [line for line in seen(tmp_path) if line.startswith("generate a=1 prompt=")]
    assert len(sampled) == (train_exit in (0, 7)), seen(tmp_path)
    assert ("Error" in done.stderr) == (make_exit != 0), done.stderr
    stopped = "make train: stopped with a checkpoint (exit 4); make train again resumes the run"
    assert (stopped in done.stdout) == (train_exit == 4), done.stdout


# -- the batch script ---------------------------------------------------------------------------
def sbatch(tmp_path, stand_in, launch, job_id=4242, **knobs) -> subprocess.CompletedProcess:
    env = fake_slurm_env(
        tmp_path / "slurm", job_id=job_id, ntasks=2 if launch == "srun" else 1, submit_dir=str(REPO)
    )
    env = clean_env(
        **{k: v for k, v in env.items() if k.startswith(("SLURM_", "FAKE_"))},
        PATH=env["PATH"],
        PYTHON=str(stand_in),
        SEEN=str(tmp_path / "seen"),
        LAUNCH=launch,
        NPROC_PER_NODE="2",
        **knobs,
    )
    return subprocess.run(
        ["bash", str(SBATCH), "x=1"], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_a_forwarded_stop_counts_as_a_stop_whatever_code_srun_reports(tmp_path, stand_in):
    """srun --kill-on-bad-exit: once one task exits 4 the others are killed, and srun may report
    a killed task's code (here every task reports 137): the job still ends as a stop."""
    env = fake_slurm_env(tmp_path / "slurm", job_id=4242, ntasks=2, submit_dir=str(REPO))
    env = clean_env(
        **{k: v for k, v in env.items() if k.startswith(("SLURM_", "FAKE_"))},
        PATH=env["PATH"],
        PYTHON=str(stand_in),
        SEEN=str(tmp_path / "seen"),
        LAUNCH="srun",
        TRAIN_WAIT_FOR_TERM="1",
        TRAIN_STOP_EXIT="137",
        FAKE_SLURM_REQUEUE="1",
    )
    log = tmp_path / "log"
    proc = start(["bash", str(SBATCH), "x=1"], log, env)
    wait_for(tmp_path / "seen", r"(?s)train ready.*train ready", proc)
    proc.send_signal(signal.SIGUSR2)  # SLURM's warning before the time limit
    code, text = finish(proc, log)
    assert code == 0, text[-2000:]
    assert "a stop was forwarded and the launcher exited with 137: treated as a stop" in text
    assert "scontrol requeue 4242" in slurm_calls(tmp_path)


def slurm_calls(tmp_path: Path) -> str:
    path = tmp_path / "slurm" / "calls"
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("launch", ["torchrun", "srun"])
@pytest.mark.parametrize("job_id,port", [(4242, 14242), (123456, 13456), (20000, 10000)])
def test_the_rendezvous_port_comes_from_the_job_id(tmp_path, stand_in, launch, job_id, port):
    done = sbatch(tmp_path, stand_in, launch, job_id=job_id)
    assert done.returncode == 0, done.stdout + done.stderr
    if launch == "torchrun":
        assert f"--rdzv-endpoint localhost:{port} --rdzv-id {job_id}" in done.stdout
    else:
        assert trains(tmp_path) == [f"train MASTER_PORT={port} CPUS= x=1"] * 2


def test_the_batch_script_asks_for_cpus_per_task():
    header = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert any(line.startswith("#SBATCH --cpus-per-task=") for line in header)


@pytest.mark.parametrize("launch", ["torchrun", "srun"])
def test_the_jobs_cpus_per_task_reach_every_srun_task(tmp_path, stand_in, launch):
    done = sbatch(tmp_path, stand_in, launch, SLURM_CPUS_PER_TASK="3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--cpus-per-task=3" in (tmp_path / "slurm" / "srun").read_text().split()
    # srun exports it to the tasks: srun tasks then keep their CPUs, torchrun's workers share them
    assert [line.split()[2] for line in trains(tmp_path)] == ["CPUS=3"] * 2


@pytest.mark.parametrize("launch", ["torchrun", "srun"])
@pytest.mark.parametrize(
    "train_exit,requeueable,knob,want,requeued",
    [
        (0, "1", "auto", 0, False),
        (3, "1", "auto", 3, False),  # a failure stays a failure
        (5, "0", "auto", 5, False),
        (4, "1", "auto", 0, True),  # stopped with a checkpoint, submitted with --requeue
        (4, "0", "auto", 0, False),  # stopped, not requeueable: COMPLETED, a chain goes on
        (4, "1", "0", 0, False),
        (4, "0", "1", 0, True),
        (7, "1", "auto", 0, False),  # the run was already complete
    ],
)
def test_the_batch_script_ends_a_stopped_or_complete_run_with_0_and_requeues_a_stopped_one(
    tmp_path, stand_in, launch, train_exit, requeueable, knob, want, requeued
):
    done = sbatch(
        tmp_path,
        stand_in,
        launch,
        TRAIN_EXIT=str(train_exit),
        FAKE_SLURM_REQUEUE=requeueable,
        REQUEUE=knob,
    )
    assert done.returncode == want, done.stdout + done.stderr
    assert f"launcher exited with {train_exit}" in done.stdout
    assert ("scontrol requeue 4242" in slurm_calls(tmp_path)) == requeued


@pytest.mark.parametrize("train_exit,cancelled", [(0, True), (7, True), (4, False), (3, False)])
def test_a_job_that_completes_the_run_cancels_the_rest_of_its_chain(
    tmp_path, stand_in, train_exit, cancelled
):
    chain_file = tmp_path / "chain.jobs"
    chain_file.write_text("4241\n4242\n4243\n4244\n")
    done = sbatch(
        tmp_path,
        stand_in,
        "srun",
        TRAIN_EXIT=str(train_exit),
        MEGATRONISH_CHAIN_FILE=str(chain_file),
    )
    assert ("scancel 4243 4244" in slurm_calls(tmp_path)) == cancelled, done.stdout
    assert "scancel 4241" not in slurm_calls(tmp_path)


def test_chain_lists_its_jobs_for_them_to_read(tmp_path):
    env = fake_slurm_env(tmp_path / "slurm")
    env.update(CHAIN_DIR=str(tmp_path / "chains"))
    done = subprocess.run(
        ["bash", str(REPO / "scripts/slurm/chain.sh"), "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    (chain_file,) = (tmp_path / "chains").iterdir()
    assert chain_file.read_text().split() == ["1001", "1002", "1003"]
    assert f"MEGATRONISH_CHAIN_FILE={chain_file}" in (tmp_path / "slurm" / "sbatch.env").read_text()
