"""Real launches: SLURM scripts under fake SLURM tools, graceful stop, elastic restart.

Every run is 2 CPU ranks of a tiny model on a small standard-library corpus (built once per
module). The interrupted runs are given ``trainer.max_steps=1000`` so they cannot finish before
the signal; the schedule is pinned by ``scheduler.decay_steps`` so that it does not depend on
``max_steps``, and the resumed runs then stop at ``FINAL``.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatronish.testing.fake_slurm import fake_slurm_env
from megatronish.testing.multiproc import free_port
from megatronish.testing.processes import (
    checkpoint_tensors,
    finish,
    start,
    training_workers,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
FINAL = 30
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.seq_length=32",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=4",
    "trainer.eval_interval=0",
    "logging.log_interval=1",
    "scheduler.warmup_steps=2",
    "scheduler.decay_steps=100",
    "data.max_corpus_mb=0.5",
    "data.vocab_size=512",
    "trainer.device=cpu",
    "trainer.peak_tflops=1",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus")


def overrides(cache_dir, out_dir, steps, *extra):
    return [
        *SMALL,
        f"data.cache_dir={cache_dir}",
        f"out_dir={out_dir}",
        f"trainer.max_steps={steps}",
        *extra,
    ]


def base_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHON=sys.executable, **extra)
    return env


def launch_local(args, log, **env):
    return start(["bash", str(REPO / "scripts/launch_local.sh"), "2", *args], log, base_env(**env))


def latest(out_dir: Path) -> str:
    return (out_dir / "checkpoints" / "latest").read_text()


def final_tensors(out_dir: Path, step: int = FINAL):
    assert latest(out_dir) == f"step_{step:07d}"
    return checkpoint_tensors(out_dir / "checkpoints" / f"step_{step:07d}")


@pytest.fixture(scope="module")
def uninterrupted(cache_dir, tmp_path_factory):
    """The final checkpoint's tensors of a run that trained to FINAL in one go."""
    out = tmp_path_factory.mktemp("uninterrupted")
    log = out / "log"
    code, text = finish(launch_local(overrides(cache_dir, out / "run", FINAL), log), log)
    assert code == 0, text[-3000:]
    return final_tensors(out / "run")


def assert_same_tensors(got, want):
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"not bit-identical: {different[:5]}"


def stopped_step(text: str, signal_name: str = "SIGTERM") -> int:
    m = re.search(rf"stopping after step (\d+) \(signal {signal_name}\); saved checkpoint", text)
    assert m, text[-3000:]
    return int(m.group(1))


# -- graceful stop and elastic restart under torchrun --------------------------------------------
@pytest.mark.slow
def test_sigterm_saves_and_stops_then_the_next_launch_survives_a_killed_worker_bit_identically(
    cache_dir, tmp_path, uninterrupted
):
    """SIGTERM to torchrun: the workers save and stop (exit 4). The next launch resumes there;
    a worker killed in it makes torchrun (``--max-restarts 1``) start a new group, which
    resumes from the latest checkpoint; the end is the uninterrupted run's, bit for bit."""
    out, log = tmp_path / "run", tmp_path / "first.log"
    proc = launch_local(overrides(cache_dir, out, 1000), log)
    wait_for(log, r"^step\s+3/1000", proc)
    proc.send_signal(signal.SIGTERM)  # launch_local.sh passes it on to torchrun, torchrun on
    code, text = finish(proc, log)
    step = stopped_step(text)
    assert 3 <= step < FINAL - 12, text[-3000:]
    assert "stopped early (signal SIGTERM), exit code 4" in text
    assert code == 4  # the workers' code, not torchrun's 1 (scripts/lib/run_torchrun.sh)
    assert latest(out) == f"step_{step:07d}"

    log = tmp_path / "second.log"
    args = overrides(cache_dir, out, FINAL, "checkpoint.interval=4")
    proc = launch_local(args, log, TORCHRUN_ARGS="--max-restarts 1")
    saved = (step // 4 + 1) * 4  # the first checkpoint this launch writes
    wait_for(log, rf"^step\s+{saved + 2}/", proc)
    workers = training_workers(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    code, text = finish(proc, log)  # torchrun stops the survivor and starts a new group
    assert code == 0, text[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{step:07d}'}" in text
    restarted = re.findall(r"resumed from \S+step_(\d+)", text)[1:]
    assert restarted and int(restarted[0]) >= saved, text[-3000:]
    assert_same_tensors(final_tensors(out), uninterrupted)


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # exited
        return False
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.MULTILINE).group(1), 16)
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.slow
def test_sigterm_just_after_the_launch_stops_every_rank_before_training_in_one_line_each(
    cache_dir, tmp_path
):
    """SIGTERM while the workers still import torch: they record it from the entry module's
    first lines, agree once their process groups exist and stop (exit 4), no rank silently
    dead or reporting a crashed peer (6), and no torchrun traceback."""
    out, log = tmp_path / "run", tmp_path / "log"
    proc = launch_local(overrides(cache_dir, out, 1000), log)
    deadline = time.monotonic() + 120
    while not (
        len(workers := training_workers(proc.pid)) == 2
        and all(catches(pid, signal.SIGTERM) for pid in workers)
    ):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # launch_local.sh passes it on to torchrun, torchrun on
    code, text = finish(proc, log)
    assert "stopping before training (signal SIGTERM): nothing trained" in text, text[-3000:]
    assert "stopped early (signal SIGTERM), exit code 4" in text
    assert code == 4 and "torchrun exited with 1, its workers with 4: exiting with 4" in text
    assert not re.search(r"^step\s", text, re.MULTILINE) and "error:" not in text
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    assert not (out / "checkpoints" / "latest").exists()
    alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}")]
    assert not alive, f"workers {alive} outlived torchrun"


# -- SLURM scripts ------------------------------------------------------------------------------
SBATCH = REPO / "scripts/slurm/train.sbatch"


def sbatch(args, log, state_dir, launch, **knobs):
    """Run train.sbatch as the batch shell of job 4242 on one fake node with 2 ranks."""
    env = fake_slurm_env(state_dir, ntasks=2 if launch == "srun" else 1, submit_dir=str(REPO))
    env.update(
        WANDB_MODE="disabled",
        OMP_NUM_THREADS="1",
        PYTHON=sys.executable,
        LAUNCH=launch,
        NPROC_PER_NODE="2",
        RDZV_PORT=str(free_port()),
        **knobs,
    )
    return start(["bash", str(SBATCH), *args], log, env)


def test_sbatch_header_asks_for_a_warning_signal_before_the_first_command():
    header = []
    for line in SBATCH.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break  # sbatch reads #SBATCH lines up to the first command only
        header.append(line)
    assert "#SBATCH --signal=B:USR2@300" in header
    assert "##SBATCH --requeue" in header  # optional: documented, off by default
    assert any(line.startswith("#SBATCH --time=") for line in header)


@pytest.mark.slow
def test_sbatch_srun_mode_usr2_saves_requeues_and_the_next_job_continues_bit_identically(
    cache_dir, tmp_path, uninterrupted
):
    state, out, log = tmp_path / "slurm", tmp_path / "run", tmp_path / "first.log"
    proc = sbatch(overrides(cache_dir, out, 1000), log, state, "srun", FAKE_SLURM_REQUEUE="1")
    wait_for(log, r"^step\s+3/1000", proc)
    proc.send_signal(signal.SIGUSR2)  # what --signal=B:USR2@300 sends before the time limit
    code, text = finish(proc, log)
    assert code == 0, text[-3000:]  # COMPLETED (here REQUEUED), not FAILED
    assert "launcher exited with 4" in text  # train.py's EXIT_STOPPED, through srun
    step = stopped_step(text)
    assert 3 <= step < FINAL
    assert latest(out) == f"step_{step:07d}"
    calls = (state / "calls").read_text()
    assert "scancel --signal=TERM 4242" in calls and "scontrol requeue 4242" in calls

    log = tmp_path / "second.log"  # the next job of the chain
    code, text = finish(sbatch(overrides(cache_dir, out, FINAL), log, state, "srun"), log)
    assert code == 0, text[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{step:07d}'}" in text
    assert_same_tensors(final_tensors(out), uninterrupted)


@pytest.mark.slow
def test_sbatch_torchrun_mode_runs_one_torchrun_per_node_and_usr2_ends_with_the_workers_code(
    cache_dir, tmp_path
):
    state, out, log = tmp_path / "slurm", tmp_path / "run", tmp_path / "job.log"
    proc = sbatch(overrides(cache_dir, out, 1000), log, state, "torchrun", FAKE_SLURM_REQUEUE="1")
    wait_for(log, r"^step\s+3/1000", proc)
    proc.send_signal(signal.SIGUSR2)
    code, text = finish(proc, log)
    command = next(line for line in text.splitlines() if line.startswith("+ srun"))
    assert "--ntasks-per-node=1" in command and "scripts/lib/run_torchrun.sh" in command
    assert "--nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:" in command
    assert "--rdzv-id 4242" in command
    assert "tp=1 dp=2 pp=1" in text
    step = stopped_step(text)
    assert "torchrun exited with 1, its workers with 4: exiting with 4" in text, text[-3000:]
    assert "launcher exited with 4" in text and code == 0
    assert "scontrol requeue 4242" in (state / "calls").read_text()
    assert latest(out) == f"step_{step:07d}"


def chain(tmp_path, *args, **knobs):
    env = fake_slurm_env(tmp_path)
    env.update(CHAIN_DIR=str(tmp_path / "chains"), **knobs)  # not the repository's outputs/
    return subprocess.run(
        ["bash", str(REPO / "scripts/slurm/chain.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_chain_submits_jobs_that_each_wait_for_the_one_before(tmp_path):
    r = chain(tmp_path, "3", "trainer.max_steps=9000", SBATCH_ARGS="--nodes=4")
    assert r.returncode == 0, r.stderr
    jobs = (tmp_path / "sbatch").read_text().splitlines()
    tail = "--nodes=4 scripts/slurm/train.sbatch trainer.max_steps=9000"
    assert jobs == [
        f"--parsable --job-name=megatronish {tail}",
        f"--parsable --job-name=megatronish --dependency=afterany:1001 {tail}",
        f"--parsable --job-name=megatronish --dependency=afterany:1002 {tail}",
    ]


def test_chain_singleton_and_bad_arguments(tmp_path):
    r = chain(tmp_path, "2", DEPENDENCY="singleton", JOB_NAME="llama7b")
    assert r.returncode == 0, r.stderr
    jobs = (tmp_path / "sbatch").read_text().splitlines()
    job = "--parsable --job-name=llama7b --dependency=singleton scripts/slurm/train.sbatch"
    assert jobs == [job, job]
    assert chain(tmp_path, "zero").returncode == 2
    r = chain(tmp_path, "2", DEPENDENCY="afterok")
    assert r.returncode == 2 and "DEPENDENCY=afterok" in r.stderr
