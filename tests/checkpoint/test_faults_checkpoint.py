"""Checkpoint faults: a rank killed mid-save, damaged checkpoints, and the fallback on resume."""

import json
import os
import re
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from megatronish.checkpoint import resume as resume_module
from megatronish.checkpoint import save as save_module
from megatronish.checkpoint.directory import LOCK_NAME, clean_stale
from megatronish.checkpoint.format import CheckpointError
from megatronish.checkpoint.load import load_into
from megatronish.checkpoint.resume import (
    auto_candidates,
    load_with_fallback,
    plan_resume,
)
from megatronish.checkpoint.save import CheckpointSaver
from megatronish.distributed.agree import PeerError
from megatronish.testing.cli import load_tool, run_main
from megatronish.testing.multiproc import WorldError, run_world
from megatronish.testing.runs import build_trainer

STEP1, STEP2 = "step_0000001", "step_0000002"


def save_two_steps(rank, world, ckpt, layout=()):
    """Train two steps, saving after each; ``latest`` names step 2, step 1 is kept."""
    trainer = build_trainer(rank, world, [f"checkpoint.dir={ckpt}", *layout], 2)
    saver = CheckpointSaver(trainer.cfg, trainer.checkpoint_parts)
    for _ in range(2):
        trainer.train_step()
        saver.save(blocking=True)


def resume(rank, world, ckpt, overrides=(), steps=2):
    """Start as ``train.run`` does: tidy ``ckpt``, then load with the fallback.

    Returns what was removed, the step resumed at (or the error) and the log lines."""
    trainer = build_trainer(rank, world, [f"checkpoint.dir={ckpt}", *overrides], steps)
    plan = plan_resume(trainer.cfg.checkpoint, trainer.topo.world_group)
    lines = []
    try:
        meta = load_with_fallback(trainer.checkpoint_parts, plan, log=lines.append)
    except CheckpointError as e:
        return plan.removed, str(e), lines
    finally:
        plan.__exit__()
    return plan.removed, meta.step if meta else None, lines


# -- a rank killed while it writes --------------------------------------------------------------


def save_then_die_mid_write(rank, world, ckpt, async_save):
    """Publish step 1; during step 2's save rank 1 is SIGKILLed after writing its first file."""
    layout = ["parallel.zero_stage=1", f"checkpoint.async_save={str(async_save).lower()}"]
    trainer = build_trainer(rank, world, [f"checkpoint.dir={ckpt}", *layout], 3)
    saver = CheckpointSaver(trainer.cfg, trainer.checkpoint_parts)
    trainer.train_step()
    saver.save(blocking=True)
    trainer.train_step()
    if rank == 1:
        write = save_module.save_safetensors

        def write_one_file_then_die(tensors, path, *args, **kwargs):
            write(tensors, path, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        save_module.save_safetensors = write_one_file_then_die  # this forked rank only
    saver.save()
    saver.wait()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_rank_killed_mid_save_keeps_latest_and_next_start_cleans_up(tmp_path, async_save):
    with pytest.raises(WorldError) as err:
        run_world(save_then_die_mid_write, 2, str(tmp_path), async_save, timeout=120)
    assert "killed by signal 9" in err.value.errors[1]
    assert (tmp_path / "latest").read_text() == STEP1
    partial = tmp_path / ".tmp_step_0000002"
    written = set(os.listdir(partial))
    assert "model-rank00001.safetensors" in written  # rank 1 died after its first file
    assert "optim-rank00001.safetensors" not in written and not (tmp_path / STEP2).exists()

    results = run_world(resume, 2, str(tmp_path), ["parallel.zero_stage=1"], timeout=120)
    assert results[0][0] == [".tmp_step_0000002"]  # rank 0 removed the partial save
    assert [step for _, step, _ in results] == [1, 1]  # and every rank loaded step 1
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME, "latest", STEP1]  # the lock file stays


def test_crash_inside_a_resave_puts_the_published_step_back(tmp_path, monkeypatch):
    trainer = build_trainer(0, 1, [f"checkpoint.dir={tmp_path}"], 2)
    saver = CheckpointSaver(trainer.cfg, trainer.checkpoint_parts)
    trainer.train_step()
    saver.save(blocking=True)
    rename = os.rename

    def crash_before_publishing(src, dst):
        if os.path.basename(src) == ".tmp_step_0000001":  # the new copy's rename: "crash"
            raise KeyboardInterrupt
        rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_before_publishing)
    with pytest.raises(KeyboardInterrupt):
        saver.save(blocking=True)  # the same step again: the old copy is moved aside first
    monkeypatch.undo()
    assert not (tmp_path / STEP1).exists() and (tmp_path / ".tmp_old_step_0000001").exists()
    assert clean_stale(str(tmp_path)) == [".tmp_step_0000001"]
    assert sorted(os.listdir(tmp_path)) == ["latest", STEP1]
    assert load_into(build_trainer(0, 1, [], 2).checkpoint_parts, str(tmp_path)).step == 1


# -- damaged checkpoints -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("two_steps")
    save_two_steps(0, 1, str(ckpt))
    return ckpt


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4)


def flip_last_byte(path):
    """Flip a bit of the last tensor's data (the end of a safetensors file)."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte ^ 0x10]))


def edit_metadata(path):
    raw = json.loads(path.read_text())
    raw["consumed_samples"] += 8
    path.write_text(json.dumps(raw, indent=1, sort_keys=True))


DAMAGE = {
    "truncated": (
        "model-rank00000.safetensors",
        truncate,
        "model-rank00000.safetensors is truncated",
    ),
    "bit-flip": (
        "optim-rank00000.safetensors",
        flip_last_byte,
        r"checksum mismatch in optim-rank00000.safetensors",
    ),
    "missing": (
        "optim-rank00000.safetensors",
        os.remove,
        "cannot open .*optim-rank00000.safetensors",
    ),
    "edited-metadata": ("metadata.json", edit_metadata, "metadata.json was changed after the save"),
    "broken-metadata": (
        "metadata.json",
        lambda p: p.write_text(p.read_text()[:-20]),
        "metadata.json is not a valid checkpoint metadata file",
    ),
}


def damaged_copy(two_steps, tmp_path, damage):
    file, spoil, _ = DAMAGE[damage]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_steps, ckpt)
    spoil(ckpt / STEP2 / file)
    return ckpt


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_detected_naming_the_file(two_steps, tmp_path, damage):
    ckpt = damaged_copy(two_steps, tmp_path, damage)
    with pytest.raises(CheckpointError, match=DAMAGE[damage][2]):
        load_into(build_trainer(0, 1, [], 2).checkpoint_parts, str(ckpt))


def test_truncated_shard_is_caught_without_verification(two_steps, tmp_path):
    ckpt = damaged_copy(two_steps, tmp_path, "truncated")
    trainer = build_trainer(0, 1, ["checkpoint.verify=false"], 2)
    with pytest.raises(CheckpointError, match=DAMAGE["truncated"][2]):
        load_into(trainer.checkpoint_parts, str(ckpt))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_auto_resume_falls_back_to_the_previous_step(two_steps, tmp_path, damage):
    ckpt = damaged_copy(two_steps, tmp_path, damage)
    _, step, lines = resume(0, 1, str(ckpt))
    assert step == 1
    assert f"skipped checkpoint {ckpt / STEP2}" in lines[0]
    assert re.search(DAMAGE[damage][2], lines[0])  # the reason
    assert lines[1].startswith(f"resumed from {ckpt / STEP1} at step 1")
    # Nothing is deleted: the damaged step is set aside, out of the way of latest and pruning.
    assert lines[2] == f"set aside damaged checkpoint {ckpt / STEP2} as damaged_{STEP2}"
    assert (ckpt / "latest").read_text() == STEP1
    assert not (ckpt / STEP2).exists()
    reason = (ckpt / f"damaged_{STEP2}" / "DAMAGED.txt").read_text()
    assert re.search(DAMAGE[damage][2], reason) and f"rename it back to {STEP2}" in reason


def test_without_fallback_a_damaged_latest_stops_the_start(two_steps, tmp_path):
    ckpt = damaged_copy(two_steps, tmp_path, "bit-flip")
    _, error, lines = resume(0, 1, str(ckpt), ["checkpoint.fallback=false"])
    assert error.startswith(f"cannot resume from {ckpt / STEP2}: checksum mismatch in optim")
    assert "checkpoint.fallback=true" in error and lines == []


def test_every_damaged_step_is_an_error_not_a_fresh_start(two_steps, tmp_path):
    ckpt = damaged_copy(two_steps, tmp_path, "missing")
    os.remove(ckpt / STEP1 / "metadata.json")
    _, error, lines = resume(0, 1, str(ckpt))
    assert error.startswith("no checkpoint could be loaded: step_0000002 (cannot open")
    assert "step_0000001 (no checkpoint at" in error and "checkpoint.resume=never" in error
    assert len(lines) == 2


def test_a_model_mismatch_is_not_skipped(two_steps, tmp_path):
    _, error, lines = resume(0, 1, str(two_steps), ["model.hidden_size=128"])
    assert "model.hidden_size: checkpoint 64, config 128" in error and lines == []


def test_a_bug_while_loading_is_not_taken_for_damage(two_steps, monkeypatch, capsys):
    def broken_load(*args):
        raise ImportError("cannot import name 'x'")

    monkeypatch.setattr(resume_module, "load_into", broken_load)
    trainer = build_trainer(0, 1, [f"checkpoint.dir={two_steps}"], 2)
    plan = plan_resume(trainer.cfg.checkpoint, trainer.topo.world_group)
    lines = []
    with pytest.raises(PeerError, match="ImportError: cannot import name 'x'"):
        load_with_fallback(trainer.checkpoint_parts, plan, log=lines.append)
    assert lines == [] and "Traceback" in capsys.readouterr().err  # nothing skipped


def test_latest_naming_a_missing_step_falls_back(two_steps, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_steps, ckpt)
    shutil.rmtree(ckpt / STEP2)
    _, step, lines = resume(0, 1, str(ckpt))
    assert step == 1 and f"no checkpoint at {ckpt / STEP2}" in lines[0]


def test_auto_candidates_follow_latest_then_older_steps(tmp_path):
    for step in (3, 5, 7):
        (tmp_path / f"step_{step:07d}").mkdir()
    (tmp_path / ".tmp_step_0000009").mkdir()
    assert auto_candidates(str(tmp_path)) == [7, 5, 3]  # no latest: every published step
    (tmp_path / "latest").write_text("step_0000005")
    assert auto_candidates(str(tmp_path)) == [5, 3]  # step 7 is not this run's history
    (tmp_path / "latest").write_text("step_0000006")
    assert auto_candidates(str(tmp_path)) == [6, 5, 3]  # a missing step is tried, and reported
    assert auto_candidates(str(tmp_path / "nothing")) == []


# -- every rank takes the same decision ----------------------------------------------------------


def test_damage_seen_by_one_rank_makes_every_rank_fall_back(tmp_path):
    tp2 = ["parallel.tp=2"]
    run_world(save_two_steps, 2, str(tmp_path), tp2)
    flip_last_byte(tmp_path / STEP2 / "model-rank00001.safetensors")  # only tp rank 1 reads it
    results = run_world(resume, 2, str(tmp_path), tp2)
    assert [step for _, step, _ in results] == [1, 1]
    for _, _, lines in results:
        assert "rank 1: checksum mismatch in model-rank00001.safetensors" in lines[0]
    os.rename(tmp_path / f"damaged_{STEP2}", tmp_path / STEP2)  # as DAMAGED.txt says
    (tmp_path / "latest").write_text(STEP2)
    stopped = run_world(resume, 2, str(tmp_path), [*tp2, "checkpoint.fallback=false"])
    assert stopped[0][1] == stopped[1][1] and "rank 1: checksum mismatch" in stopped[0][1]


def test_resume_never_and_an_explicit_path(two_steps, tmp_path):
    trainer = build_trainer(0, 1, ["checkpoint.resume=never", f"checkpoint.dir={two_steps}"], 2)
    plan = plan_resume(trainer.cfg.checkpoint, trainer.topo.world_group)
    with plan:
        assert plan.candidates == [] and load_with_fallback(trainer.checkpoint_parts, plan) is None
    step1 = f"checkpoint.resume={two_steps / STEP1}"
    assert resume(0, 1, str(tmp_path / "new"), [step1])[1] == 1


# -- every file a resume reads: the RNG and gradient-compression states too ---------------------

STATES = ["parallel.zero_stage=1", "parallel.grad_compression=int8"]  # error feedback per rank


def save_two_steps_with_states(rank, world, ckpt):
    """As :func:`save_two_steps`, with every rank's RNG streams and int8 error feedback saved."""
    trainer = build_trainer(
        rank, world, [f"checkpoint.dir={ckpt}", *STATES], 2, checkpoint_rng=True
    )
    saver = CheckpointSaver(trainer.cfg, trainer.checkpoint_parts)
    for _ in range(2):
        trainer.train_step()
        saver.save(blocking=True)


def resume_with_states(rank, world, ckpt, overrides=()):
    """:func:`resume` of a checkpoint of :func:`save_two_steps_with_states`; also returns this
    rank's error feedback after the load."""
    layout = [f"checkpoint.dir={ckpt}", *STATES, *overrides]
    trainer = build_trainer(rank, world, layout, 2, checkpoint_rng=True)
    state = trainer.zero.compressor.state_dict()
    for t in state.values():
        t.fill_(7.0)  # a load that restores nothing leaves this (or zeros)
    plan = plan_resume(trainer.cfg.checkpoint, trainer.topo.world_group)
    try:
        meta = load_with_fallback(trainer.checkpoint_parts, plan, log=lambda line: None)
        step = meta.step
    except CheckpointError as e:
        step = str(e)
    finally:
        plan.__exit__()
    return step, {k: t.clone() for k, t in state.items()}


@pytest.fixture(scope="module")
def with_states(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("with_states")
    run_world(save_two_steps_with_states, 2, str(ckpt))
    return ckpt


RANK_FILE_DAMAGE = {  # (file, spoil, fragment of the reason, which names the file's path)
    "compression-bit-flip": ("compression-rank00001.safetensors", flip_last_byte, "checksum mis"),
    "compression-truncated": ("compression-rank00001.safetensors", truncate, "is truncated"),
    "compression-missing": ("compression-rank00001.safetensors", os.remove, "is missing"),
    "rng-bit-flip": ("rng-rank00001.safetensors", flip_last_byte, "checksum mismatch"),
    "rng-truncated": ("rng-rank00001.safetensors", truncate, "is truncated"),
}


@pytest.mark.parametrize("damage", list(RANK_FILE_DAMAGE))
def test_a_damaged_rng_or_compression_file_stops_the_resume_naming_it(
    with_states, tmp_path, capfd, damage
):
    file, spoil, fragment = RANK_FILE_DAMAGE[damage]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(with_states, ckpt)
    spoil(ckpt / STEP2 / file)
    results = run_world(resume_with_states, 2, str(ckpt), ["checkpoint.fallback=false"])
    errors = [step for step, _ in results]
    assert isinstance(errors[0], str) and errors[0] == errors[1], errors  # every rank, the same
    assert "rank 1: " in errors[0] and str(ckpt / STEP2 / file) in errors[0], errors[0]
    assert fragment in errors[0], errors[0]
    assert len(errors[0].splitlines()) == 1
    # tools/checkpoint_info.py --verify names it too (exit 1)
    capfd.readouterr()
    code, _, err = run_main(load_tool("checkpoint_info").main, [ckpt, "--verify"], capfd)
    assert code == 1 and file in err and "verify: FAILED" in err, err


def test_a_checkpoint_from_before_file_checksums_loads_its_states_unchecked(
    with_states, tmp_path, capfd
):
    """Metadata without ``files`` (and without its crc32, as one edited by hand): the RNG and
    error feedback are restored as saved, and ``--verify`` says they were not verified."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(with_states, ckpt)
    path = ckpt / STEP2 / "metadata.json"
    raw = json.loads(path.read_text())
    del raw["files"], raw["crc32"]
    path.write_text(json.dumps(raw, indent=1, sort_keys=True))
    saved = [load_file(ckpt / STEP2 / f"compression-rank{r:05d}.safetensors") for r in (0, 1)]
    results = run_world(resume_with_states, 2, str(ckpt))
    assert [step for step, _ in results] == [2, 2]
    for (_, state), want in zip(results, saved):
        assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    capfd.readouterr()
    code, out, _ = run_main(load_tool("checkpoint_info").main, [ckpt, "--verify"], capfd)
    assert code == 0 and "verify: OK" in out
    assert "not verified" in out and "compression-rank00001.safetensors" in out
    assert "rng-rank00000.safetensors" in out
