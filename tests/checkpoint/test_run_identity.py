"""Run identity: which saved run a command continues, sweeps in their own directories, W&B ids
unique per run and kept across its resumes; a finished run says so (exit 7)."""

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from megatronish.checkpoint.run_identity import (
    ConfigChanged,
    RunComplete,
    check_same_run,
    config_changes,
    flatten,
)
from megatronish.config.compose import load_config
from megatronish.config.sweep import MAX_NAME, job_dir_name, swept_keys
from megatronish.testing.runs import SMALL_STDLIB_RUN

# The schedule is pinned (decay_steps), so that raising max_steps continues the same run.
BASE = [*SMALL_STDLIB_RUN, "scheduler.decay_steps=10"]


def resolved(*overrides):
    return OmegaConf.to_container(load_config(list(overrides)), resolve=True)


def test_flatten_names_nested_keys_with_dots():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None}) == {
        "a.b": 1,
        "a.c.d": [1, 2],
        "e": None,
    }


def test_what_changes_the_run_is_a_change_and_the_layout_and_logging_are_not():
    saved = resolved()  # max_steps 300: the schedule decays over 300 steps
    same_run = resolved(
        "parallel.tp=2",
        "parallel.zero_stage=3",
        "trainer.max_steps=900",
        "scheduler.decay_steps=300",
        "logging.log_interval=1",
        "checkpoint.interval=5",
        "name=other",
        "trainer.micro_batch_size=4",
        "trainer.recompute=full",
    )
    assert config_changes(saved, same_run) == []
    other = resolved(
        "optimizer.lr=6e-4",
        "trainer.seed=5",
        "model.num_layers=2",
        "trainer.global_batch_size=32",
        "data.vocab_size=512",
    )
    changed = {k for k, _, _ in config_changes(saved, other)}
    assert changed == {
        "optimizer.lr",
        "trainer.seed",
        "model.num_layers",
        "trainer.global_batch_size",
        "data.vocab_size",
    }


GRADIENT_REDUCTION = [
    "parallel.grad_compression=int8",
    "parallel.powersgd_rank=8",
    "parallel.powersgd_compress_vocab=true",
    "parallel.grad_compression_start_step=10",
    "parallel.grad_reduce_dtype=bf16",
]


@pytest.mark.parametrize("change", GRADIENT_REDUCTION)
def test_how_the_gradient_is_reduced_is_part_of_the_run(change):
    """The parallel section may change on resume (any layout), but not the compression of the
    gradient reduction nor its dtype: they change the gradient every step applies."""
    key = change.partition("=")[0]
    saved, now = resolved("parallel.zero_stage=1"), resolved("parallel.zero_stage=1", change)
    assert [k for k, _, _ in config_changes(saved, now)] == [key]
    with pytest.raises(ConfigChanged) as e:
        check_same_run(saved, 1, now, "ck/step_1")
    assert f"checkpoint.allow_changes=[{key}]" in str(e.value) and "name=NEW_NAME" in str(e.value)
    for allowed in (key, "parallel"):  # the key, or the whole section, on purpose
        check_same_run(saved, 1, resolved(change, f"checkpoint.allow_changes=[{allowed}]"), "p")


def test_compiling_is_not_a_change_of_the_run():
    compiled = resolved(
        "trainer.compile=true", "trainer.compile_backend=aot_eager", "trainer.compile_cache_dir=/c"
    )
    assert config_changes(resolved(), compiled) == []


@pytest.mark.parametrize(
    "entry, hint",
    [("optimizer.lrr", "did you mean optimizer.lr?"), ("optimiser", "did you mean optimizer?")],
)
def test_an_allow_changes_entry_that_names_no_key_is_refused(entry, hint):
    now = resolved("optimizer.lr=6e-4", f"checkpoint.allow_changes=[{entry}]")
    with pytest.raises(ConfigChanged) as e:
        check_same_run(resolved(), 1, now, "p")
    message = str(e.value)
    assert message.startswith(f"checkpoint.allow_changes has '{entry}', which is no key or section")
    assert message.endswith(hint) and len(message.splitlines()) == 1
    for entry in ("optimizer", "model.moe.router", "optimizer.lr"):  # sections and keys are fine
        check_same_run(resolved(), 1, resolved(f"checkpoint.allow_changes=[{entry}]"), "p")


def test_allow_changes_takes_keys_and_whole_sections():
    saved, now = resolved(), resolved("optimizer.lr=6e-4", "optimizer.beta2=0.99", "trainer.seed=5")
    assert [k for k, _, _ in config_changes(saved, now, ["optimizer"])] == ["trainer.seed"]
    assert [k for k, _, _ in config_changes(saved, now, ["optimizer.lr"])] == [
        "optimizer.beta2",
        "trainer.seed",
    ]
    # a prefix of a key's name is not its section
    assert len(config_changes(saved, now, ["optimizer.b"])) == 3


def test_keys_only_one_side_has_are_a_version_difference_not_a_change():
    saved = resolved()
    del saved["checkpoint"]["allow_changes"], saved["model"]["rope_theta"]
    saved["old_key"] = 1
    assert config_changes(saved, resolved()) == []


def test_a_changed_config_is_refused_with_every_difference_and_the_ways_forward():
    saved = resolved()
    with pytest.raises(ConfigChanged) as e:
        check_same_run(saved, 10, resolved("optimizer.lr=6e-4", "trainer.seed=5"), "ck/step_10")
    message = str(e.value)
    assert "optimizer.lr: 0.001 (saved) -> 0.0006" in message and "trainer.seed: 1234" in message
    assert (
        "name=NEW_NAME" in message
        and "checkpoint.allow_changes=[optimizer.lr,trainer.seed]" in message
    )
    allowed = resolved(
        "optimizer.lr=6e-4",
        "trainer.seed=5",
        "checkpoint.allow_changes=[optimizer.lr,trainer.seed]",
    )
    check_same_run(saved, 10, allowed, "ck/step_10")  # allowed, and steps are left


def test_allow_model_changes_also_allows_the_config_key():
    saved = resolved()
    now = resolved("model.rope_theta=500000", "checkpoint.allow_model_changes=[rope_theta]")
    check_same_run(saved, 1, now, "p")
    with pytest.raises(ConfigChanged, match="model.rope_theta"):
        check_same_run(saved, 1, resolved("model.rope_theta=500000"), "p")


def test_raising_max_steps_is_another_run_unless_the_schedule_stays_the_same():
    saved = resolved("trainer.max_steps=300")  # scheduler.decay_steps null: decays over 300
    with pytest.raises(ConfigChanged) as e:
        check_same_run(saved, 300, resolved("trainer.max_steps=400"), "p")
    assert "scheduler.decay_steps (null: trainer.max_steps): 300 (saved) -> 400" in str(e.value)
    # The way forward keeps the saved schedule; allowing the change would make the lr jump.
    assert "Keep the saved learning-rate schedule with scheduler.decay_steps=300" in str(e.value)
    assert "allow_changes" not in str(e.value) and len(str(e.value).splitlines()) == 1
    with pytest.raises(ConfigChanged) as e:
        check_same_run(saved, 300, resolved("trainer.max_steps=400", "optimizer.lr=6e-4"), "p")
    assert "scheduler.decay_steps=300" in str(e.value)
    assert "the other changes on purpose (checkpoint.allow_changes=[optimizer.lr])" in str(e.value)
    check_same_run(saved, 300, resolved("trainer.max_steps=400", "scheduler.decay_steps=300"), "p")
    constant = resolved("trainer.max_steps=300", "scheduler.style=constant")
    check_same_run(
        constant, 300, resolved("trainer.max_steps=400", "scheduler.style=constant"), "p"
    )


def test_a_run_at_or_past_max_steps_is_complete_and_a_longer_one_is_not():
    saved = resolved("trainer.max_steps=300")
    with pytest.raises(RunComplete) as e:
        check_same_run(saved, 300, resolved("trainer.max_steps=300"), "ck/step_0000300")
    assert e.value.step == 300 and "already complete at step 300" in str(e.value)
    with pytest.raises(RunComplete):
        check_same_run(saved, 300, resolved("trainer.max_steps=50"), "p")
    check_same_run(saved, 300, resolved("trainer.max_steps=600", "scheduler.decay_steps=300"), "p")


def test_the_swept_keys_of_a_command_line():
    argv = [
        "-m",
        "optimizer.lr=1e-3,6e-4",
        "trainer.seed=range(1,3)",
        "trainer.max_steps=5",
        "+experiment=tiny",
        "--cfg",
        "job",
        "model=glob(tiny*)",
    ]
    assert swept_keys(argv) == {"optimizer.lr", "trainer.seed", "model"}
    assert swept_keys(["optimizer.lr=[1,2"]) is None  # Hydra reports it


@pytest.mark.parametrize(
    "overrides, swept, name",
    [
        (["trainer.max_steps=5", "optimizer.lr=0.001"], {"optimizer.lr"}, "optimizer.lr=0.001"),
        (
            ["data.prefix=data/web doc", "optimizer.lr=0.001"],
            {"optimizer.lr", "data.prefix"},
            "data.prefix=data_web_doc,optimizer.lr=0.001",
        ),
        (["optimizer.lr=0.001", "+experiment=tiny"], None, "+experiment=tiny,optimizer.lr=0.001"),
        (["trainer.max_steps=5"], set(), "default"),
    ],
)
def test_a_sweep_job_directory_is_named_by_its_swept_values_and_safe(overrides, swept, name):
    assert job_dir_name(overrides, swept) == name


def test_a_long_sweep_job_name_keeps_its_start_and_a_hash_of_all_of_it():
    a, b = ["x=" + "1" * 300], ["x=" + "1" * 299 + "2"]
    assert len(job_dir_name(a, None)) == MAX_NAME and job_dir_name(a, None).startswith("x=111")
    assert job_dir_name(a, None) != job_dir_name(b, None)


def train(args, out, cache):
    """``python -m megatronish.train`` in a subprocess, run directory ``out``."""
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "megatronish.train",
        *args,
        f"data.cache_dir={cache}",
        f"out_dir={out}",
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def _metadata(ckpt, step):
    return json.loads((ckpt / f"step_{step:07d}" / "metadata.json").read_text())


@pytest.mark.slow
def test_a_run_resumes_refuses_another_config_and_says_when_it_is_complete(tmp_path, stdlib_cache):
    """One directory through a run's life: trained, resumed longer (same W&B id), refused with
    another config, continued with the change allowed, complete (exit 7); another directory is
    another run id."""
    out = tmp_path / "out"

    def run_train(args):
        return train(args, out, stdlib_cache)

    base = BASE
    first = run_train([*base, "trainer.max_steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = out / "checkpoints"
    run_id = _metadata(ckpt, 2)["trainer"]["run_id"]
    assert run_id.startswith("tiny-") and run_id != "tiny-local"

    longer = run_train([*base, "trainer.max_steps=4", "parallel.zero_stage=1"])
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "resumed from" in longer.stdout and _metadata(ckpt, 4)["trainer"]["run_id"] == run_id

    refused = run_train([*base, "trainer.max_steps=6", "optimizer.lr=6e-4"])
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "optimizer.lr: 0.001 (saved) -> 0.0006" in refused.stderr
    assert "Traceback" not in refused.stderr and not (ckpt / "step_0000006").exists()

    allowed = run_train(
        [
            *base,
            "trainer.max_steps=6",
            "optimizer.lr=6e-4",
            "checkpoint.allow_changes=[optimizer.lr]",
        ]
    )
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert _metadata(ckpt, 6)["config"]["optimizer"]["lr"] == 6e-4

    done = run_train([*base, "trainer.max_steps=6", "optimizer.lr=6e-4"])
    assert done.returncode == 7, done.stdout + done.stderr
    assert "already complete at step 6" in done.stdout

    log = (out / "train.log").read_text().splitlines()
    starts = [ln for ln in log if "=== start of run" in ln]
    assert len(starts) == 3 and all(run_id in ln for ln in starts)  # refused/complete: no log
    assert any("step      6/6" in ln for ln in log)

    other = train([*base, "trainer.max_steps=2", "name=other"], tmp_path / "b", stdlib_cache)
    assert other.returncode == 0, other.stderr[-3000:]
    other_id = _metadata(tmp_path / "b" / "checkpoints", 2)["trainer"]["run_id"]
    assert other_id.startswith("other-") and other_id != run_id


@pytest.mark.slow
def test_every_job_of_a_sweep_trains_in_its_own_directory(tmp_path, stdlib_cache):
    args = ["-m", "optimizer.lr=1e-3,6e-4", *BASE, "trainer.max_steps=2"]
    r = train(args, tmp_path / "out", stdlib_cache)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted(p for p in (tmp_path / "out").iterdir() if p.is_dir())
    assert len(jobs) == 2, os.listdir(tmp_path / "out")
    ids, lrs = set(), set()
    for job in jobs:
        meta = _metadata(job / "checkpoints", 2)
        ids.add(meta["trainer"]["run_id"])
        lrs.add(meta["config"]["optimizer"]["lr"])
        assert job.name == f"optimizer.lr={meta['config']['optimizer']['lr']:g}"
    assert lrs == {1e-3, 6e-4} and len(ids) == 2
    # the same sweep again: each job is complete, none fails
    again = train(args, tmp_path / "out", stdlib_cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already complete at step 2") == 2
