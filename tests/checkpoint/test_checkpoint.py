"""Sharded safetensors checkpoints: format, atomic publish, async save, reshard, exact resume."""

import json
import os

import pytest
import torch

from megatronish.checkpoint.directory import clean_stale
from megatronish.checkpoint.format import CheckpointError, read_metadata, resolve_step_dir
from megatronish.checkpoint.load import check_tensor_shapes, load_into
from megatronish.checkpoint.save import CheckpointSaver
from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, losses_of, merge_params, train_layout

# Runs save at step STOP and resume to END. The LR schedule must not depend on where a run stops:
# it decays over END steps everywhere.
STOP, END = 3, 6
SCHED = [f"scheduler.decay_steps={END}"]
THREE_D = ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.sp=true"]
HYBRID = ["parallel.zero_shard_size=2"]  # on 4 ranks: two shard groups of 2 dp ranks
_REF = {}


def reference():
    if "ref" not in _REF:
        _REF["ref"] = [train_layout(0, 1, SCHED, END)]
    return _REF["ref"]


def run(world, layout, steps, load=None, save=None):
    args = ([*SCHED, *layout], steps, load, save)
    if world == 1:
        return [train_layout(0, 1, *args)]
    return run_world(train_layout, world, *args, timeout=300)


def stop_and_resume(tmp_path, first, second):
    (wa, a), (wb, b) = first, second
    saved = run(wa, a, STOP, save=str(tmp_path))
    resumed = run(wb, b, END, load=str(tmp_path))
    return saved, resumed


@pytest.mark.parametrize(
    "first, second",
    [
        ((2, ["parallel.tp=2"]), (1, [])),
        ((1, []), (4, ["parallel.tp=4"])),
        ((2, ["parallel.pp=2", "parallel.vpp=2"]), (1, [])),
        ((1, []), (4, ["parallel.pp=4"])),
        ((2, ["parallel.zero_stage=1"]), (4, ["parallel.zero_stage=3"])),
        ((8, [*THREE_D, "parallel.zero_stage=1"]), (1, [])),
        ((1, []), (8, [*THREE_D, "parallel.zero_stage=2"])),
        ((4, ["parallel.cp=2", "parallel.zero_stage=1"]), (1, [])),
        ((2, ["parallel.cp=2", "parallel.zero_stage=3"]), (4, ["parallel.cp=4"])),
        ((1, []), (4, ["parallel.cp=2", "parallel.tp=2", "parallel.zero_stage=2"])),
        ((4, [*HYBRID, "parallel.zero_stage=3"]), (2, ["parallel.zero_stage=1"])),
        ((2, ["parallel.zero_stage=2"]), (4, [*HYBRID, "parallel.zero_stage=1"])),
    ],
    ids=[
        "tp2-tp1",
        "tp1-tp4",
        "pp2vpp2-pp1",
        "pp1-pp4",
        "zero1dp2-zero3dp4",
        "3d-1",
        "1-3d",
        "cp2dp2-1",
        "cp2zero3-cp4",
        "1-tp2cp2",
        "hybrid-zero1dp2",
        "zero2dp2-hybrid",
    ],
)
def test_reshard_on_load_continues_the_run(tmp_path, first, second):
    saved, resumed = stop_and_resume(tmp_path, first, second)
    ref = reference()
    joined = losses_of(saved) + losses_of(resumed)
    assert len(joined) == END
    norms = saved[0].grad_norms + resumed[0].grad_norms
    got = [type(ref[0])(losses=joined, grad_norms=norms, params=merge_params(resumed))]
    assert_parity(ref, got)


def test_exact_resume_single_process_is_bit_identical(tmp_path):
    saved, resumed = stop_and_resume(tmp_path, (1, []), (1, []))
    ref = reference()
    assert losses_of(saved) + losses_of(resumed) == losses_of(ref)
    for name, value in merge_params(ref).items():
        assert torch.equal(merge_params(resumed)[name], value), name


def test_exact_resume_3d_layout_is_bit_identical(tmp_path):
    layout = [*THREE_D, "parallel.zero_stage=1"]
    straight = run(8, layout, END)
    saved, resumed = stop_and_resume(tmp_path, (8, layout), (8, layout))
    assert losses_of(saved) + losses_of(resumed) == losses_of(straight)
    a, b = merge_params(straight), merge_params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "layout",
    [["parallel.tp=2", "parallel.zero_stage=1"], [*HYBRID, "parallel.zero_stage=3"]],
    ids=["tp2-zero1", "hybrid-zero3"],
)
def test_format_each_shard_once_with_checksums(tmp_path, layout):
    run(4, layout, 2, save=str(tmp_path))
    step_dir = resolve_step_dir(str(tmp_path))
    assert (tmp_path / "latest").read_text() == "step_0000002"
    meta = read_metadata(step_dir)
    assert meta.step == 2 and meta.consumed_samples == 16
    assert meta.layout["tp"] == (2 if "parallel.tp=2" in layout else 1)
    assert meta.config["model"]["hidden_size"] == 64
    for name, entry in meta.tensors.items():
        covered = sum(int(torch.tensor([n for _, n in s.offsets]).prod()) for s in entry.shards)
        assert covered == int(torch.tensor(entry.shape).prod()), name  # disjoint and complete
        assert all(s.crc32 for s in entry.shards)
    kinds = {n.split("/")[0] for n in meta.tensors}
    assert kinds == {"model", "exp_avg", "exp_avg_sq"}
    files = sorted(os.listdir(step_dir))
    assert "metadata.json" in files and "rng-rank00003.safetensors" in files
    assert not any(f.startswith("index-") for f in files)


def test_cp_leaves_no_trace_in_the_tensors(tmp_path):
    """A cp=2 checkpoint holds the same tensors, shapes and shards as a cp=1 one of the same
    dp x cp: cp only splits activations; its ranks' ZeRO shards are dp shards of the file."""
    run(2, ["parallel.cp=2", "parallel.zero_stage=1"], 1, save=str(tmp_path / "cp"))
    run(2, ["parallel.zero_stage=1"], 1, save=str(tmp_path / "dp"))
    cp = read_metadata(resolve_step_dir(str(tmp_path / "cp")))
    dp = read_metadata(resolve_step_dir(str(tmp_path / "dp")))
    assert cp.layout["cp"] == 2 and dp.layout["cp"] == 1
    assert {n: (e.shape, [s.offsets for s in e.shards]) for n, e in cp.tensors.items()} == {
        n: (e.shape, [s.offsets for s in e.shards]) for n, e in dp.tensors.items()
    }


def test_keep_last_prunes_after_publish_and_stale_tmp_is_cleaned(tmp_path):
    (tmp_path / ".tmp_step_0000009").mkdir()  # left by a crash mid-save
    assert clean_stale(str(tmp_path)) == [".tmp_step_0000009"]
    trainer = build_trainer(0, 1, ["checkpoint.keep_last=2", f"checkpoint.dir={tmp_path}"], 4)
    saver = CheckpointSaver(trainer.cfg, trainer.checkpoint_parts)
    for _ in range(4):
        trainer.train_step()
        saver.save(blocking=True)
    steps = sorted(d for d in os.listdir(tmp_path) if d.startswith("step_"))
    assert steps == ["step_0000003", "step_0000004"]
    assert (tmp_path / "latest").read_text() == "step_0000004"


def test_async_save_matches_sync_save(tmp_path):
    trainer = build_trainer(0, 1, [f"checkpoint.dir={tmp_path / 'a'}"], 3)
    trainer.train_step()
    sync = CheckpointSaver(trainer.cfg, trainer.checkpoint_parts).save(blocking=True)
    saver = CheckpointSaver(trainer.cfg, trainer.checkpoint_parts)
    saver.dir = str(tmp_path / "b")
    assert saver.save(blocking=False) is None  # written in the background
    trainer.train_step()  # training continues meanwhile
    published = saver.wait()
    a, b = read_metadata(sync), read_metadata(published)
    assert a.step == b.step == 1
    for name, entry in a.tensors.items():
        assert [s.crc32 for s in entry.shards] == [s.crc32 for s in b.tensors[name].shards]


def test_mismatched_model_is_refused_with_the_difference(tmp_path):
    run(1, [], 1, save=str(tmp_path))
    trainer = build_trainer(0, 1, ["model.hidden_size=128"], 1)
    with pytest.raises(CheckpointError, match="model.hidden_size: checkpoint 64, config 128"):
        load_into(trainer.checkpoint_parts, str(tmp_path))
    meta_path = os.path.join(resolve_step_dir(str(tmp_path)), "metadata.json")
    raw = json.load(open(meta_path))
    raw["format_version"] = 99
    json.dump(raw, open(meta_path, "w"))
    with pytest.raises(CheckpointError, match="format version 99"):
        load_into(build_trainer(0, 1, [], 1).checkpoint_parts, str(tmp_path))


def test_tensors_that_would_be_cut_or_dropped_are_refused(tmp_path):
    run(1, ["model.arch=gpt2"], 1, save=str(tmp_path / "gpt2"))
    longer = build_trainer(0, 1, ["model.arch=gpt2", "model.max_position_embeddings=32"], 1)
    with pytest.raises(CheckpointError, match=r"embedding.position: checkpoint \[16, 64\]"):
        load_into(longer.checkpoint_parts, str(tmp_path / "gpt2"))
    run(1, [], 1, save=str(tmp_path / "llama"))
    tied = build_trainer(0, 1, ["model.tie_embeddings=true"], 1)
    with pytest.raises(
        CheckpointError, match="model.tie_embeddings: checkpoint False, config True"
    ):
        load_into(tied.checkpoint_parts, str(tmp_path / "llama"))
    normed = build_trainer(0, 1, ["model.qk_norm=true", "model.head_dim=32"], 1)
    with pytest.raises(
        CheckpointError,
        match="model.head_dim: checkpoint 8, config 32; model.qk_norm: checkpoint False, config",
    ):
        load_into(normed.checkpoint_parts, str(tmp_path / "llama"))
    meta = read_metadata(resolve_step_dir(str(tmp_path / "llama")))
    meta.config = {}  # a checkpoint without its config: the tensors alone are compared
    with pytest.raises(CheckpointError, match="not in this model: head.weight"):
        check_tensor_shapes(meta, tied.spec, "llama")


def test_resaving_an_older_step_keeps_latest_and_its_directory(tmp_path):
    trainer = build_trainer(0, 1, ["checkpoint.keep_last=1", f"checkpoint.dir={tmp_path}"], 3)
    saver = CheckpointSaver(trainer.cfg, trainer.checkpoint_parts)
    trainer.train_step()
    saver.save(blocking=True)
    saver.save(blocking=True)  # the same step again replaces it in place
    assert (tmp_path / "latest").read_text() == "step_0000001"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_0000001"]
