"""Invalid configurations end the job on every rank: exit 2 and one line naming the problem.

The rules themselves are tested in test_config_validation.py; this file checks what a user sees.
Most cases run ``megatronish.train.main_with_config`` in a forked 2-rank world (``RANK`` and
``WORLD_SIZE`` set as torchrun sets them). Errors Hydra raises while composing (unknown key,
wrong type, unknown experiment, unparsable override) are refused on every rank of a real
torchrun job here, and case by case in test_tool_inputs_cli.py.
"""

import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from megatronish.config.compose import load_config
from megatronish.data.indexed import IndexedDatasetWriter
from megatronish.testing.multiproc import run_world


def _tiny_indexed_dataset() -> str:
    """A valid .bin/.idx prefix (a data-free stand-in: the rules only look at the files)."""
    prefix = os.path.join(tempfile.mkdtemp(prefix="bad-config-"), "corpus")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([1, 2, 3])
    return prefix


INDEXED = _tiny_indexed_dataset()


def _unwritable_dir() -> str:
    """A directory this process cannot create entries in: a read-only one, or for root (whom
    the mode bits do not stop) a path in sysfs, which refuses new entries to everyone."""
    if os.geteuid() == 0:
        return "/sys/megatronish-compile-cache"
    path = tempfile.mkdtemp(prefix="bad-config-ro-")
    os.chmod(path, 0o555)
    return os.path.join(path, "cache")


UNWRITABLE = _unwritable_dir()
MOE = ["model.moe.num_experts=4"]

# Refused in the same words by training, dry runs and the planner (each in a 2-rank world).
EVERY_CONTEXT = [
    (
        ["parallel.cp_comm_type=a2a_ring", "parallel.cp_a2a_size=2"],
        "parallel.cp_a2a_size=2 groups cp ranks for cp_comm_type=a2a_ring, and parallel.cp=1 has "
        "none to group (context parallelism is off): set cp_a2a_size to null, or parallel.cp to "
        "a multiple of 2 above it (e.g. cp=4)",
    ),
    (
        ["data.reset_attention_mask=true", "data.document_boundaries=4096"],
        "data.document_boundaries=4096 is not an id of the vocabulary of 4096 tokens "
        "(data.vocab_size, the tokenizer the built-in corpus trains; ids 0 to 4095)",
    ),
    (
        ["model.moe.router.score=tanh"],
        "model.moe.router.score=tanh is not one of softmax, sigmoid",
    ),
    (
        ["parallel.powersgd_compress_vocab=true"],
        "parallel.powersgd_compress_vocab=true chooses the matrices PowerSGD compresses, and "
        "parallel.grad_compression=null is not powersgd",
    ),
    (
        ["parallel.zero_stage=1", "parallel.grad_compression=int8"]
        + ["parallel.powersgd_compress_vocab=true"],
        "parallel.grad_compression=int8 is not powersgd: set it to false, or "
        "grad_compression=powersgd",
    ),
    (
        ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=55"],
        "parallel.powersgd_rank=55 compresses none of this model's matrices (PowerSGD compresses "
        "an n x m grad where (n + m) * rank * 2 < n * m; the most compressible, the mlp fc1 per "
        "rank, 704 x 128, takes rank 54 at most): use parallel.powersgd_rank <= 54",
    ),
    (
        [*MOE, "model.moe.router.num_groups=0", "model.moe.router.max_groups=1"],
        "model.moe.router.num_groups=0 must be >= 1",
    ),
]

# (overrides, a phrase the reason must contain); each breaks exactly one rule in a 2-rank world.
CASES = [
    (["parallel.pp=4", "trainer.global_batch_size=32"], "world size 2 is not divisible by tp*pp"),
    (["parallel.dp=4", "trainer.global_batch_size=32"], "tp*pp*dp = 1*1*4 = 4"),
    (["world_size=4"], "world_size=4 but the job was launched with 2"),
    (
        ["parallel.tp=2", "model.num_attention_heads=6", "model.num_query_groups=3"]
        + ["model.head_dim=16"],
        "num_query_groups=3 (kv heads) and parallel.tp=2: one must divide the other",
    ),
    (["model.num_query_groups=3"], "num_query_groups=3 must divide model.num_attention_heads=4"),
    (["model.hidden_size=130"], "hidden_size=130 is not divisible by model.num_attention_heads=4"),
    (["parallel.tp=2", "model.ffn_hidden_size=353"], "ffn hidden size 353 is not divisible"),
    (["parallel.tp=2", "parallel.sp=true", "model.seq_length=255"], "seq_length=255"),
    (["parallel.pp=2", "model.num_layers=5"], "num_layers=5 is not divisible by pp*vpp"),
    (["parallel.pp=2", "parallel.pipeline_layer_split=[1,2]"], "pipeline_layer_split=[1, 2]"),
    (["trainer.global_batch_size=12"], "global_batch_size=12 is not divisible"),
    (
        ["parallel.pp=2", "trainer.micro_batch_size=16", "trainer.global_batch_size=16"],
        "fewer than parallel.pp=2",
    ),
    (
        ["parallel.pp=2", "parallel.vpp=2", "trainer.global_batch_size=24"],
        "needs microbatches per step (3) divisible by parallel.pp=2",
    ),
    (["parallel.vpp=2"], "vpp=2 needs parallel.pp > 1"),
    (
        ["parallel.pp=2", "parallel.vpp=3", "parallel.pipeline_schedule=zbv", "model.num_layers=6"],
        "pipeline_schedule=zbv runs two chunks per stage in a V: set parallel.vpp=2, not 3",
    ),
    (["parallel.zero_stage=4"], "zero_stage=4 must be 0, 1, 2 or 3"),
    (["model.num_layers=0"], "model.num_layers=0 must be >= 1"),
    (["model.hidden_size=-128"], "model.hidden_size=-128 must be >= 1"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size=0 must be >= 1"),
    (["trainer.max_skipped_steps=-1"], "trainer.max_skipped_steps=-1 must be >= 0"),
    (["parallel.collective_timeout_s=0"], "parallel.collective_timeout_s=0.0 must be > 0"),
    (["model.arch=gpt3"], "model.arch='gpt3' is not one of llama, gpt2"),
    (["optimizer.lr=0"], "optimizer.lr=0.0 must be > 0"),
    (["model.hidden_dropout=1.5"], "hidden_dropout=1.5 must be in [0, 1)"),
    (["+trainer.max_step=3"], "unknown key trainer.max_step"),
    (["data=indexed", f"data.tokenizer_model={__file__}"], "needs data.prefix"),
    (
        ["data=indexed", "data.prefix=/nonexistent/corpus", f"data.tokenizer_model={__file__}"],
        "/nonexistent/corpus.idx does not exist",
    ),
    # Accepted silently or with a traceback before they were rules.
    (["optimizer.beta1=1.0"], "optimizer.beta1=1.0 must be in [0, 1)"),
    (["optimizer.beta2=-0.1"], "optimizer.beta2=-0.1 must be in [0, 1)"),
    (["optimizer.eps=-1e-8"], "optimizer.eps=-1e-08 must be > 0"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay=-0.1 must be >= 0"),
    (["model.rope_theta=0"], "model.rope_theta=0.0 must be > 0"),
    (["model.norm_eps=0"], "model.norm_eps=0.0 must be > 0"),
    (["model.norm_eps=nan"], "model.norm_eps=nan is not a finite number"),
    (["model.init_std=-0.02"], "model.init_std=-0.02 must be > 0"),
    (["trainer.num_threads=0"], "trainer.num_threads=0 must be >= 1"),
    (["trainer.peak_tflops=0"], "trainer.peak_tflops=0.0 must be > 0"),
    (["trainer.seed=-1"], "trainer.seed=-1 must be >= 0"),
    (["data.vocab_size=300"], "data.vocab_size=300 is too small to train a tokenizer"),
    (["data.max_corpus_mb=0"], "data.max_corpus_mb=0.0 must be > 0"),
    (["name="], "name='' is empty: every unnamed run would share outputs/"),
    (
        ["model.max_position_embeddings=128"],
        "model.seq_length=256 exceeds model.max_position_embeddings=128",
    ),
    (
        ["checkpoint.keep_last=0"],
        "checkpoint.keep_last=0 would keep no checkpoint; use null to keep every step",
    ),
    (
        [
            "data=indexed",
            f"data.prefix={INDEXED}",
            f"data.tokenizer_model={os.path.dirname(INDEXED)}",
        ],
        "is a directory without a tokenizer.json; give a sentencepiece .model file",
    ),
    # What a hurried user types.
    (["optimizer.lr=nan"], "optimizer.lr=nan is not a finite number"),
    (["optimizer.grad_clip=inf"], "optimizer.grad_clip=inf is not a finite number"),
    (["trainer.eval_iters=0"], "trainer.eval_iters=0 with trainer.eval_interval=100"),
    (["checkpoint.resume=none"], "checkpoint.resume='none' reads like a keyword, not a path"),
    (["checkpoint.resume=Auto"], "checkpoint.resume='Auto' reads like a keyword"),
    (
        ["logging.wandb_mode=ofline"],
        "logging.wandb_mode='ofline' is not one of online, offline, disabled",
    ),
    (
        ["optimizer.lr=0.1", "optimizer.weight_decay=10"],
        "optimizer.lr*weight_decay = 0.1*10.0 >= 1",
    ),
    (["data.cache_dir="], "data.cache_dir is empty"),
    (
        ["checkpoint.allow_model_changes=[hidden_size]"],
        "checkpoint.allow_model_changes has hidden_size: only rope_theta",
    ),
    (["out_dir="], "out_dir is empty"),
    (
        ["checkpoint.dir="],
        "checkpoint.dir is empty; set a directory, or null to save no checkpoints",
    ),
    (
        ["trainer.profile.steps=[400,405]"],
        "trainer.profile.steps=[400, 405] starts after trainer.max_steps=300",
    ),
    (["trainer.exit_after_minutes=0"], "trainer.exit_after_minutes=0.0 must be positive"),
    (["trainer.stop_signals=[SIGFOO]"], "trainer.stop_signals has SIGFOO: not a signal"),
    (["parallel.grad_reduce_dtype=bf16"], "grad_reduce_dtype=bf16 needs trainer.precision=bf16"),
    (["parallel.grad_reduce_dtype=fp16"], "parallel.grad_reduce_dtype='fp16' is not one of"),
    # Where inductor writes, checked before the first compiled step (it raised there).
    (
        ["trainer.compile=true", f"trainer.compile_cache_dir={INDEXED}.idx"],
        f"trainer.compile_cache_dir={INDEXED}.idx is a file, not a directory: give a directory "
        "this user can write (created when missing), or null for torch's cache",
    ),
    (
        ["trainer.compile=true", f"trainer.compile_cache_dir={INDEXED}.idx/cache"],
        f"trainer.compile_cache_dir={INDEXED}.idx/cache is inside the file {INDEXED}.idx",
    ),
    (
        ["trainer.compile=true", f"trainer.compile_cache_dir={UNWRITABLE}"],
        f"trainer.compile_cache_dir={UNWRITABLE} cannot be written (",
    ),
    *EVERY_CONTEXT,
]
if not torch.cuda.is_available():  # the rule is about this machine
    CASES.append(
        (["trainer.device=cuda"], "trainer.device=cuda but this machine has no CUDA device")
    )


def _main_with_every_config(rank, world, configs):
    import megatronish.train as entry

    def accepted(cfg, stop=None, launch=None):
        raise AssertionError("an invalid config was accepted")

    entry.run = accepted  # this forked rank only: a valid config must not start training
    out = []
    for cfg in configs:
        err, std = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
            code = entry.main_with_config(cfg)
        out.append((code, err.getvalue(), std.getvalue()))
    return out


@pytest.fixture(scope="module")
def every_rank(starts_processes):
    configs = [load_config(overrides) for overrides, _ in CASES]  # composed once, forked twice
    return run_world(_main_with_every_config, 2, configs)


def _id(overrides: list[str]) -> str:
    """Without the temporary directories: the same in every pytest process that collects it."""
    text = " ".join(overrides).replace(os.path.dirname(INDEXED), "TMP")
    return text.replace(os.path.dirname(UNWRITABLE), "UNWRITABLE")


IDS = [_id(c[0]) for c in CASES]


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_invalid_config_exits_2_with_one_line_on_every_rank(every_rank, index):
    needle = CASES[index][1]
    for rank, results in enumerate(every_rank):
        code, err, out = results[index]
        assert code == 2
        assert out == ""
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"[rank {rank}] invalid config: ") and needle in lines[0], err


@pytest.mark.parametrize("overrides, needle", EVERY_CONTEXT, ids=[_id(c[0]) for c in EVERY_CONTEXT])
def test_dry_runs_and_the_planner_refuse_it_in_the_same_words(overrides, needle, capsys):
    import megatronish.train as entry
    from megatronish.plan.cli import main as plan

    dry = entry.main_with_config(load_config([*overrides, "trainer.dry_run=true", "world_size=2"]))
    assert dry == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [err.strip()], err
    assert err.startswith("invalid config: ") and needle in err, err
    assert plan([*overrides, "world_size=2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [err.strip()], err
    assert err.startswith("invalid config: ") and needle in err, err


# Settings that do nothing here: one note from rank 0, and the run goes on.
NOTES = [
    (
        ["parallel.sp=true"],
        "parallel.sp=true has no effect with parallel.tp=1 (sequence parallelism splits the "
        "sequence over the tp group): the run is the same as with sp=false",
    ),
    (
        ["trainer.device=cpu", "parallel.optimizer_offload=true"],
        "parallel.optimizer_offload=true moves nothing on the CPU (trainer.device=cpu): the "
        "optimizer's state already is in host memory",
    ),
    (
        [*MOE, "parallel.moe_dispatch_order=ep_first"],
        "parallel.moe_dispatch_order=ep_first has no effect with parallel.tp=1: it orders the "
        "all-to-all over ep and the gather over tp, and one tp rank gathers nothing",
    ),
    (
        ["model.moe.top_k=4", "model.moe.router.z_loss_coef=0.001"],
        "model.moe.top_k=4, model.moe.router.z_loss_coef=0.001 have no effect on a dense model "
        "(model.moe.num_experts=0: no block routes tokens to experts)",
    ),
    (
        ["trainer.fp8_skip_first_last=1"],
        "trainer.fp8_skip_first_last=1 has no effect without trainer.fp8 (no block runs in fp8 "
        "to keep in bf16)",
    ),
    (
        ["parallel.grad_compression=powersgd", "trainer.max_steps=10"]
        + ["parallel.grad_compression_start_step=10"],
        "parallel.grad_compression_start_step=10 is not before trainer.max_steps=10: every step "
        "reduces its grads uncompressed (parallel.grad_compression=powersgd never starts)",
    ),
    (
        ["trainer.compile_cache_dir=/tmp/inductor"],
        "trainer.compile_cache_dir=/tmp/inductor has no effect without trainer.compile=true "
        "(nothing is compiled)",
    ),
]
NOTE_IDS = [" ".join(c[0]) for c in NOTES]


def _main_with_notes(rank, world, configs):
    import megatronish.train as entry

    entry.run = lambda cfg, stop=None, launch=None: []  # this forked rank only: nothing to train
    out = []
    for cfg in configs:
        std = io.StringIO()
        with contextlib.redirect_stdout(std):
            code = entry.main_with_config(cfg)
        out.append((code, std.getvalue()))
    return out


@pytest.fixture(scope="module")
def noted_on_every_rank(starts_processes):
    return run_world(_main_with_notes, 2, [load_config(overrides) for overrides, _ in NOTES])


@pytest.mark.parametrize("index", range(len(NOTES)), ids=NOTE_IDS)
def test_a_setting_that_does_nothing_is_noted_once_and_runs(noted_on_every_rank, index):
    note = NOTES[index][1]
    (code0, out0), (code1, out1) = (results[index] for results in noted_on_every_rank)
    assert code0 == code1 == 0
    assert out0.splitlines() == [f"note: {note}"]
    assert out1 == ""


@pytest.mark.parametrize("overrides, note", NOTES, ids=NOTE_IDS)
def test_dry_runs_and_the_planner_say_the_same_note(overrides, note, capsys):
    import megatronish.train as entry
    from megatronish.plan.cli import main as plan

    dry = load_config([*overrides, "trainer.dry_run=true", "world_size=2"])
    for run in (lambda: entry.main_with_config(dry), lambda: plan([*overrides, "world_size=2"])):
        code = run()
        out, err = capsys.readouterr()
        assert code == 0, err
        assert [line for line in out.splitlines() if line.startswith("note:")] == [f"note: {note}"]


# -- the real command line ----------------------------------------------------------------------

TORCHRUN = (
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node",
    "2",
    # torchrun stops the other ranks once one fails; a slow monitor lets each rank exit
    # by itself, so the test sees what every rank does (5 s was not enough while the suite
    # starts many processes: a rank still importing torch was stopped before it could print).
    "--monitor-interval",
    "15",
)


def run_cli(args, tmp_path, launcher=(sys.executable,)):
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [*launcher, "-m", "megatronish.train", *args, f"out_dir={tmp_path / 'out'}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


# One torchrun job: a composition error, found before any rank exists. Errors of the composed
# config take the same exit on every rank (test_invalid_config_exits_2_with_one_line_on_every_rank).
@pytest.mark.slow
@pytest.mark.parametrize(
    "args, reason", [(["model.not_a_key=1"], "invalid config: unknown key model.not_a_key")]
)
def test_every_torchrun_rank_exits_2_with_the_reason(tmp_path, args, reason):
    r = run_cli(args, tmp_path, launcher=TORCHRUN)
    assert r.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] {reason}" in r.stderr, r.stderr[-3000:]
    # torchrun's summary: exit 2, or its own SIGTERM for a rank still shutting down after the
    # first one exited (on a loaded machine that can take longer than the monitor interval).
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", r.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, r.stderr[-3000:]
