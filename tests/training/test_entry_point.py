"""`python -m megatronish.train`: dry run, bad configs, `--cfg job` (its ``main`` in this
process), and end to end in subprocesses: a real run that resumes, and torchrun."""

import os
import subprocess
import sys
import time

import pytest

SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.seq_length=64",
    "trainer.micro_batch_size=4",
    "trainer.global_batch_size=8",
    "trainer.eval_interval=5",
    "trainer.eval_iters=1",
    "logging.log_interval=5",
    "scheduler.warmup_steps=2",
    "data.max_corpus_mb=0.5",
    "data.vocab_size=512",
    "trainer.device=cpu",
]


def run_train(args, tmp_path, launcher=(sys.executable, "-m", "megatronish.train"), timeout=240):
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    cmd = [*launcher, *args, f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'out'}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def train_main(tmp_path, capfd, monkeypatch):
    """``megatronish.train.main`` with a command line, in this process (what the entry point
    does before it starts any process group): its exit code, stdout and stderr."""
    import megatronish.train as entry

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)

    def run(args):
        extra = [f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'out'}"]
        monkeypatch.setattr(sys, "argv", ["train", *args, *extra])
        code = 0
        try:
            entry.main()
        except SystemExit as e:
            code = e.code
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def test_dry_run_prints_derived_values_and_exits(train_main, tmp_path):
    r = train_main(["+experiment=gpt_1b", "trainer.dry_run=true", "world_size=8"])
    assert r.returncode == 0, r.stderr
    for key in ("microbatches_per_step", "tokens_per_step", "padded_vocab_size", "parameters"):
        assert key in r.stdout
    params = int(r.stdout.split("parameters: ")[1].split()[0].replace(",", ""))
    assert 1.0e9 <= params <= 1.5e9
    assert not (tmp_path / "out").exists()  # a dry run writes nothing, no empty out_dir


def test_long_context_experiment_dry_runs_and_plans_with_cp(tmp_path, capsys):
    from megatronish.config.compose import load_config
    from megatronish.plan.cli import main as plan_main
    from megatronish.train import dry_run_report

    cfg = load_config(["+experiment=gpt_1b_32k", "model.vocab_size=32000", "world_size=8"])
    report = dry_run_report(cfg, 8)
    assert "layout: tp=1 cp=4 pp=1 vpp=1 dp=2" in report and "seq_length: 32768" in report
    assert " rank | tp | cp | dp | pp" in report and "    7 |  0 |  3 |  1 |  0" in report
    code = plan_main(
        ["+experiment=gpt_1b_32k", "model.vocab_size=32000", "world_size=8", "device=h100"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tp=1 cp=4 pp=1 dp=2" in out and "cp/all_gather" in out and "fits" in out


def test_cfg_job_prints_the_composed_config(train_main):
    r = train_main(["--cfg", "job", "parallel.tp=2"])
    assert r.returncode == 0 and "tp: 2" in r.stdout


def test_invalid_config_exits_2_with_every_reason(train_main, tmp_path):
    t0 = time.time()
    r = train_main(["parallel.tp=3", "trainer.global_batch_size=7"])
    assert r.returncode == 2
    assert "not divisible by parallel.tp=3" in r.stderr and "global_batch_size=7" in r.stderr
    assert "Traceback" not in r.stderr
    assert time.time() - t0 < 30
    assert not (tmp_path / "out").exists()


def test_a_broken_interpolation_is_an_invalid_config_not_a_traceback(train_main):
    r = train_main(["name=${nonexistent.key}", "trainer.dry_run=true"])
    assert r.returncode == 2, r.stderr
    assert "invalid config: Interpolation key 'nonexistent.key' not found" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_default_pipeline_trains_and_saves_on_the_stdlib_corpus(tmp_path):
    r = run_train([*SMALL, "trainer.max_steps=10"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step")]
    assert len(lines) == 3 and "tok/s" in lines[-1] and "MFU" in lines[-1]
    assert "valid loss" in r.stdout
    assert "hidden_size: 64" in (tmp_path / "out" / "config.yaml").read_text()
    ckpt = tmp_path / "out" / "checkpoints"
    assert (ckpt / "latest").read_text() == "step_0000010"
    assert (ckpt / "step_0000010" / "metadata.json").exists()
    # resumes from latest: a longer run with the first one's schedule
    again = run_train([*SMALL, "trainer.max_steps=12", "scheduler.decay_steps=10"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "step     12/12" in again.stdout
    assert (ckpt / "latest").read_text() == "step_0000012"


@pytest.mark.slow
def test_torchrun_runs_plain_data_parallel(tmp_path):
    launcher = (
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "megatronish.train",
    )
    r = run_train([*SMALL, "trainer.max_steps=5"], tmp_path, launcher=launcher)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tp=1 dp=2 pp=1" in r.stdout
    assert "step      5/5" in r.stdout


def test_a_dry_run_needs_no_tokenizer_file_and_says_what_it_assumed(train_main, tmp_path):
    r = train_main(
        ["data=indexed", f"data.tokenizer_model={tmp_path / 'tok.model'}", "trainer.dry_run=true"]
    )
    assert r.returncode == 0, r.stderr
    assert (
        "does not exist yet" in r.stdout and "vocab_size: 4096 (data.vocab_size assumed" in r.stdout
    )
    (tmp_path / "bad.model").write_text("not a model")
    bad = train_main(
        ["data=indexed", f"data.tokenizer_model={tmp_path / 'bad.model'}", "trainer.dry_run=true"]
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("invalid config: ") and "bad.model" in bad.stderr
