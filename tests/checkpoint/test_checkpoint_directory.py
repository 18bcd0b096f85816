"""The checkpoint directory under faults: writes that fail, pruning around damaged steps, a
directory that cannot be written or is shared by two runs. Nothing published is ever lost."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
from safetensors import SafetensorError

from megatronish.checkpoint import save as save_module
from megatronish.checkpoint.directory import (
    LOCK_NAME,
    RunLock,
    clean_stale,
    collect_probes,
    prune,
    write_probe,
)
from megatronish.checkpoint.format import CheckpointError
from megatronish.checkpoint.load import load_into
from megatronish.checkpoint.resume import load_with_fallback, plan_resume
from megatronish.checkpoint.save import CheckpointSaver
from megatronish.distributed.agree import PeerError
from megatronish.distributed.comm import single_group
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import SMALL_STDLIB_RUN, build_trainer


def step(n: int) -> str:
    return f"step_{n:07d}"


def published(ckpt) -> list[str]:
    return sorted(d for d in os.listdir(ckpt) if d.startswith("step_"))


# -- a write that fails -------------------------------------------------------------------------
NO_SPACE = "Error while serializing: I/O error: No space left on device (os error 28)"


def _save_then_fail(rank, world, ckpt, failing_rank, async_save):
    """Publish step 1; step 2's save fails on ``failing_rank`` as a full disk makes it fail."""
    layout = ["parallel.zero_stage=1", f"checkpoint.async_save={str(async_save).lower()}"]
    trainer = build_trainer(rank, world, [f"checkpoint.dir={ckpt}", *layout], 3)
    saver = CheckpointSaver(trainer.cfg, trainer.checkpoint_parts)
    trainer.train_step()
    saver.save(blocking=True)
    write = save_module.save_safetensors

    def full_disk(tensors, path):
        if rank == failing_rank and "optim" in path:
            raise SafetensorError(NO_SPACE)
        write(tensors, path)

    save_module.save_safetensors = full_disk  # this forked rank only
    trainer.train_step()
    try:
        saver.save()
        saver.wait()
    except CheckpointError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_write_names_the_file_and_cause_and_keeps_the_published_step(tmp_path, async_save):
    errors = run_world(_save_then_fail, 2, str(tmp_path), 1, async_save)
    path = tmp_path / ".tmp_step_0000002" / "optim-rank00001.safetensors"
    for error in errors:  # the same one line on every rank
        assert error.startswith(
            f"rank 1: saving checkpoint step 2 failed: {path}: No space left on device (os error 28)"
        ), error
        assert "resumes from the latest" in error
    assert "(latest: step_0000001)" in errors[0]  # rank 0 reads the directory
    assert (tmp_path / "latest").read_text() == step(1)
    assert sorted(os.listdir(tmp_path)) == ["latest", step(1)]  # the partial step is gone
    fresh = build_trainer(0, 1, [], 3).checkpoint_parts
    assert load_into(fresh, str(tmp_path)).step == 1  # and step 1 verifies


def test_write_failures_read_as_the_cause():
    cause = save_module.write_failure("/ckpt/f", SafetensorError(NO_SPACE))
    assert cause == "/ckpt/f: No space left on device (os error 28)"
    assert save_module.write_failure("/ckpt/f", OSError(27, "File too large")) == (
        "/ckpt/f: File too large (errno 27)"
    )


# -- pruning and damaged steps ------------------------------------------------------------------
def test_prune_never_removes_the_step_latest_names_nor_damaged_steps(tmp_path):
    for n in (5, 6, 7):
        (tmp_path / step(n)).mkdir()
    (tmp_path / step(3)).mkdir()  # re-saved after a resume from an older step: latest
    (tmp_path / f"damaged_{step(9)}").mkdir()
    prune(str(tmp_path), keep_last=2, keep=step(3))
    assert published(tmp_path) == [step(3), step(7)]
    assert (tmp_path / f"damaged_{step(9)}").exists()
    prune(str(tmp_path), keep_last=1, keep=step(3))
    assert published(tmp_path) == [step(3)]
    prune(str(tmp_path), keep_last=None, keep=step(3))  # null keeps every step
    assert published(tmp_path) == [step(3)]


def test_after_a_fallback_resume_pruning_keeps_the_good_step_not_the_damaged_one(tmp_path):
    """Steps 2 (good) and 4 (damaged) with keep_last=2: the run resumes from 2 and saves 3."""
    trainer = build_trainer(0, 1, [f"checkpoint.dir={tmp_path}", "checkpoint.keep_last=2"], 4)
    saver = CheckpointSaver(trainer.cfg, trainer.checkpoint_parts)
    for n in range(1, 5):
        trainer.train_step()
        if n % 2 == 0:
            saver.save(blocking=True)
    shard = tmp_path / step(4) / "model-rank00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])  # truncated
    trainer = build_trainer(0, 1, [f"checkpoint.dir={tmp_path}", "checkpoint.keep_last=2"], 4)
    with plan_resume(trainer.cfg.checkpoint, trainer.topo.world_group) as plan:
        lines = []
        assert load_with_fallback(trainer.checkpoint_parts, plan, log=lines.append).step == 2
        assert f"set aside damaged checkpoint {tmp_path / step(4)} as damaged_{step(4)}" in lines
        trainer.train_step()
        CheckpointSaver(trainer.cfg, trainer.checkpoint_parts).save(blocking=True)
    assert published(tmp_path) == [step(2), step(3)]
    assert (tmp_path / "latest").read_text() == step(3)
    assert (tmp_path / f"damaged_{step(4)}" / "DAMAGED.txt").exists()


def test_a_damaged_step_is_not_set_aside_when_nothing_loads(tmp_path):
    """Damage that every step shows may be the reader's (a mount, a version): keep it all."""
    trainer = build_trainer(0, 1, [f"checkpoint.dir={tmp_path}"], 2)
    CheckpointSaver(trainer.cfg, trainer.checkpoint_parts).save(blocking=True)
    os.remove(tmp_path / step(0) / "metadata.json")
    with plan_resume(trainer.cfg.checkpoint, trainer.topo.world_group) as plan:
        with pytest.raises(CheckpointError, match="no checkpoint could be loaded"):
            load_with_fallback(trainer.checkpoint_parts, plan, log=lambda line: None)
    assert published(tmp_path) == [step(0)] and (tmp_path / "latest").read_text() == step(0)


# -- start-up checks ----------------------------------------------------------------------------
def _plan(ckpt_dir: str, world_group=None):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"resume": "auto", "dir": ckpt_dir, "fallback": True})
    return plan_resume(cfg, world_group or single_group("world"), label="test")


def _as_nobody(ckpt_dir: str) -> str:
    """In a forked child without root's override of permissions: what plan_resume says."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        message = "started"
        try:
            if os.getuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            with _plan(ckpt_dir):
                pass
        except PeerError as e:
            message = str(e)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            message = f"{type(e).__name__}: {e}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        message = f.read()
    os.waitpid(pid, 0)
    return message


def test_a_read_only_checkpoint_dir_is_refused_at_start_up():
    parent = tempfile.mkdtemp()
    try:
        os.chmod(parent, 0o755)
        ckpt = os.path.join(parent, "ckpt")
        os.mkdir(ckpt, 0o555)
        message = _as_nobody(ckpt)
        assert message == (
            f"cannot use checkpoint.dir={ckpt} (Permission denied); fix its permissions or set "
            "checkpoint.dir to a writable directory"
        ), message
        assert os.listdir(ckpt) == []
        message = _as_nobody(os.path.join(ckpt, "new"))  # cannot be created
        assert "(Permission denied)" in message, message
    finally:
        shutil.rmtree(parent)


def test_a_checkpoint_dir_below_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(
        PeerError, match=r"cannot use checkpoint.dir=.*file/ckpt \(Not a directory\)"
    ):
        _plan(str(tmp_path / "file" / "ckpt"))


def test_a_directory_that_ranks_do_not_share_is_refused(tmp_path):
    assert write_probe(str(tmp_path), 7, 0) is None  # rank 1 wrote to its own node's copy
    message = collect_probes(str(tmp_path), 7, 2)
    assert "rank 0 does not see the files that ranks 1 wrote there" in message
    assert "a filesystem that every node mounts" in message
    assert os.listdir(tmp_path) == []  # rank 0's probe is removed


def _probe_world(rank, world, ckpt):
    from megatronish.distributed.topology import Topology

    topo = Topology.build(tp=1, dp=world, pp=1, rank=rank)
    with _plan(ckpt, topo.world_group) as plan:
        return plan.lock is not None


def test_every_rank_probes_the_directory_and_rank_0_holds_the_lock(tmp_path):
    assert run_world(_probe_world, 2, str(tmp_path)) == [True, False]
    assert os.listdir(tmp_path) == [LOCK_NAME]  # no probe left behind


def test_cleanup_that_fails_says_so_instead_of_claiming_success(tmp_path, monkeypatch):
    (tmp_path / ".tmp_step_0000009").mkdir()

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with pytest.raises(
        OSError,
        match=r"cannot remove .*\.tmp_step_0000009, left by an "
        r"interrupted save \(Permission denied\); remove it by hand",
    ):
        clean_stale(str(tmp_path))


HOLD = """
import sys
from megatronish.checkpoint.directory import RunLock
lock = RunLock.acquire(sys.argv[1], "first-run")
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_second_run_is_refused_naming_the_first_and_a_killed_run_leaves_no_lock(tmp_path):
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout.readline() == "locked\n"
        with pytest.raises(PeerError) as refused:
            _plan(str(tmp_path))
        message = str(refused.value)
        assert message.startswith(f"checkpoint.dir={tmp_path} is in use by another run (host ")
        assert f"pid {first.pid}, started 20" in message and "run first-run" in message
        assert "give this run its own checkpoint.dir" in message
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with _plan(str(tmp_path)) as plan:  # the lock died with its process
        assert plan.lock is not None
    with _plan(str(tmp_path)):  # and is released at the end of a run
        with pytest.raises(CheckpointError, match="in use by another run"):
            RunLock.acquire(str(tmp_path))


# -- through the entry point --------------------------------------------------------------------


def _train(tmp_path, steps, file_size_limit=None):
    import resource

    def limit():
        if file_size_limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "megatronish.train",
        *SMALL_STDLIB_RUN,
        f"trainer.max_steps={steps}",
        "scheduler.decay_steps=4",  # the same schedule whatever max_steps: one run
        f"data.cache_dir={tmp_path / 'cache'}",
        f"out_dir={tmp_path / 'out'}",
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env=env, preexec_fn=limit
    )


@pytest.mark.slow
def test_a_file_size_limit_at_save_exits_3_with_one_line_and_the_run_resumes_later(tmp_path):
    assert _train(tmp_path, 2).returncode == 0
    ckpt = tmp_path / "out" / "checkpoints"
    limited = _train(tmp_path, 4, file_size_limit=64 << 10)  # as `ulimit -f 64` would
    assert limited.returncode == 3, limited.stderr[-3000:]
    (line,) = limited.stderr.splitlines()
    assert line.startswith(f"error: saving checkpoint step 4 failed: {ckpt}/.tmp_step_0000004/")
    assert (
        ": File too large (os error 27); the checkpoints published before are unchanged "
        "(latest: step_0000002)" in line
    )
    assert sorted(os.listdir(ckpt)) == [LOCK_NAME, "latest", step(2)]
    again = _train(tmp_path, 4)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt / step(2)} at step 2" in again.stdout  # verified on load
