"""Bad command lines of ``python -m megatronish.train`` (what Hydra refuses while composing),
``python -m megatronish.plan`` and ``python -m megatronish.generate``: exit 2 with one line on
stderr naming the value and the fix (Hydra's own fix kept), never a traceback; a key given
twice is refused rather than silently taking the last; a mistyped key or option gets the
closest valid ones ("did you mean ...?").

Every case calls the entry point's ``main`` in this process (the trainer's with a patched
``sys.argv``); test_cli_help.py runs every entry point's ``--help``.
"""

import sys

import pytest

import megatronish.train as train_entry
from megatronish.config.cli_errors import repeated_keys_reason
from megatronish.config.compose import load_config
from megatronish.config.validate import config_errors
from megatronish.generate.cli import main as generate_main
from megatronish.plan.cli import main as plan_main
from megatronish.testing.cli import assert_one_line, run_main

# -- python -m megatronish.train: composing the config ------------------------------------------

TRAIN_CASES = [
    (["model.not_a_key=1"], "invalid config: unknown key model.not_a_key: check the spelling"),
    (["model.num_layers=four"], "invalid config: model.num_layers: Value 'four' of type 'str'"),
    (
        ["+experiment=does_not_exist"],
        "invalid config: experiment 'does_not_exist' does not exist; choose one of: gpt_125m",
    ),
    (["parallel.tp"], "invalid config: cannot parse the override 'parallel.tp'"),
    (["experiment=tiny"], "to append to your default list use +experiment=tiny"),
    (
        ["+trainer.max_steps=3"],
        "An item is already at 'trainer.max_steps'; either remove + prefix: 'trainer.max_steps=3'; "
        "or add a second + to add or override 'trainer.max_steps': '++trainer.max_steps=3'",
    ),
    (
        ["+data=indexed"],
        "config group data already has a value; to choose indexed write data=indexed",
    ),
    (["trainer=4"], "Config group override must be a string or a list"),
    (
        ["trainer.max_steps=3", "trainer.max_steps=5"],
        "trainer.max_steps is given twice (trainer.max_steps=3, trainer.max_steps=5); only the last "
        "would count: give it once",
    ),
    (["model.num_layers=2", "+model.num_layers=4"], "model.num_layers is given twice"),
    (
        ["data.prefix=/data/corpus"],
        "data.prefix=/data/corpus is ignored by data.source=stdlib, which trains on the built-in "
        "corpus; add data=indexed",
    ),
    (
        ["data.tokenizer_model=/t/spm.model"],
        "data.tokenizer_model=/t/spm.model is ignored by data.source=stdlib",
    ),
    # A mistyped key or option: the closest valid ones.
    (
        ["trainer.max_step=5"],
        "invalid config: unknown key trainer.max_step: did you mean trainer.max_steps? "
        "(docs/config.md lists every key)",
    ),
    (
        ["optimizer.learning_rate=1e-3"],
        "unknown key optimizer.learning_rate: did you mean optimizer.lr?",
    ),
    (
        ["parallel.tensor_parallel=2"],
        "unknown key parallel.tensor_parallel: did you mean parallel.tp?",
    ),
    (["trainer.lr=1e-3"], "unknown key trainer.lr: did you mean optimizer.lr?"),
    (["modle.hidden_size=64"], "unknown key modle: did you mean model?"),
    (
        ["~trainer.max_step"],
        "cannot delete trainer.max_step: no such key; did you mean ~trainer.max_steps?",
    ),
    (
        ["model=gpt1b"],
        "config group model 'gpt1b' does not exist; did you mean model=gpt_1b? choose one of: gpt_125m",
    ),
    (["+experiment=gpt1b"], "experiment 'gpt1b' does not exist; did you mean +experiment=gpt_1b?"),
]


@pytest.mark.parametrize("args, fragment", TRAIN_CASES, ids=[" ".join(c[0]) for c in TRAIN_CASES])
def test_train_command_line_is_refused_in_one_line(tmp_path, capfd, monkeypatch, args, fragment):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    # A dry run: a config that were wrongly accepted would print and return 0, not train.
    argv = ["train", *args, "trainer.dry_run=true", f"out_dir={tmp_path}"]
    monkeypatch.setattr(sys, "argv", argv)
    code, out, err = run_main(lambda _: train_entry.main(), None, capfd)
    assert_one_line(code, err, 2, fragment)
    assert err.startswith("invalid config: ") and out == ""


def test_data_rules_refuse_indexed_keys_only_where_they_would_be_ignored():
    errors = config_errors(load_config(["data.prefix=/d/c", "data.tokenizer_model=/t.model"]), 1)
    assert len(errors) == 2 and all("add data=indexed" in e for e in errors)
    indexed = ["data=indexed", "data.prefix=/nope/c", "data.tokenizer_model=/nope.model"]
    assert not any("is ignored" in e for e in config_errors(load_config(indexed), 1))


def test_repeated_keys_ignore_flags_and_count_prefixed_keys():
    assert repeated_keys_reason(["--cfg", "job", "a=1", "b=2", "--resolve"]) is None
    assert "a is given 3 times (a=1, ++a=2, ~a)" in repeated_keys_reason(["a=1", "++a=2", "~a"])


# -- python -m megatronish.plan -------------------------------------------------------------------

PLAN_CASES = [
    (
        ["world_size=0"],
        "invalid config: world_size=0 must be >= 1 (the number of ranks to plan for)",
    ),
    (["world_size=-2"], "world_size=-2 must be >= 1"),
    (["world_size=x"], "world_size: Value 'x' of type 'str' could not be converted to Integer"),
    (["world_size=2.5"], "world_size: Value '2.5' of type 'float' could not be converted"),
    (["peak_tflops=-5"], "invalid option: peak_tflops=-5.0 must be > 0; give TFLOP/s per device"),
    (["peak_tflops=0"], "peak_tflops=0.0 must be > 0"),
    (["peak_tflops=nan"], "peak_tflops=nan is not a finite number"),
    (["step_time_s=0"], "step_time_s=0.0 must be > 0; give seconds per step, e.g. step_time_s=8"),
    (["step_time_s=-1"], "step_time_s=-1.0 must be > 0"),
    (["step_time_s=inf"], "step_time_s=inf is not a finite number"),
    (["device_memory_gb=abc"], "invalid option: device_memory_gb=abc: expected GiB per device"),
    (["device_memory_gb=0"], "device_memory_gb=0.0 must be > 0"),
    (["device_memory_gb=-3"], "device_memory_gb=-3.0 must be > 0"),
    (["device_memory_gb=nan"], "device_memory_gb=nan is not a finite number"),
    (["device_memory_gb=inf"], "device_memory_gb=inf is not a finite number"),
    (["top=x", "advise=true"], "top=x: expected a whole number, e.g. top=10"),
    (["advise=maybe"], "advise=maybe: expected true or false"),
    (
        ["advise=true", "world_size=2", "peak_tflops=1", "efficiency=nan"],
        "efficiency=nan is not a finite number",
    ),
    (
        ["advise=true", "world_size=2", "peak_tflops=1", "latency_us=inf"],
        "latency_us=inf is not a finite number",
    ),
    (
        ["advise=true", "world_size=2", "peak_tflops=1", "advise_out="],
        "advise_out='' must name a file",
    ),
    (
        ["device_memory_gb=1", "device_memory_gb=80"],
        "invalid option: device_memory_gb is given twice (device_memory_gb=1, device_memory_gb=80)",
    ),
    (
        ["trainer.max_steps=3", "trainer.max_steps=5"],
        "invalid config: trainer.max_steps is given twice",
    ),
    (["experiment=tiny"], "use +experiment=tiny"),
    (["device_mem_gb=80"], "unknown key device_mem_gb: did you mean device_memory_gb?"),
    (["parallel.tensor_model_parallel_size=2"], "did you mean parallel.tp?"),
]


@pytest.mark.parametrize("args, fragment", PLAN_CASES, ids=[" ".join(c[0]) for c in PLAN_CASES])
def test_plan_refuses_in_one_line(capfd, args, fragment):
    code, out, err = run_main(plan_main, args, capfd)
    assert_one_line(code, err, 2, fragment)
    assert out == ""


# -- python -m megatronish.generate ---------------------------------------------------------------

GENERATE_CASES = [
    (["temperature=inf"], 2, "temperature=inf must be a finite number > 0, e.g. temperature=0.8"),
    (["temperature=nan"], 2, "temperature=nan must be a finite number > 0"),
    (["temperature=-1"], 2, "temperature=-1.0 must be a finite number > 0"),
    (["top_p=nan"], 2, "top_p=nan must be in (0, 1]"),
    (["top_p=inf"], 2, "top_p=inf must be in (0, 1]"),
    (["seed=-1"], 2, "seed=-1: expected a whole number in [0, 2**64)"),
    (["seed=99999999999999999999999"], 2, "expected a whole number in [0, 2**64)"),
    (
        ["temperature=0.5", "temperature=2"],
        2,
        "temperature is given twice (temperature=0.5, temperature=2); only the last would count",
    ),
    (["prompt=y"], 2, "prompt is given twice"),
    (["checkpoint="], 2, "checkpoint=: expected a checkpoint.dir or a step_XXXXXXX directory"),
    (
        ["tokenizer_model="],
        2,
        "tokenizer_model=: expected a sentencepiece .model, a tokenizer.json",
    ),
    (["max_tokens=5"], 2, "unknown option max_tokens=5; did you mean max_new_tokens? the options"),
    (["checkpoint={d}/nowhere"], 3, "error: no checkpoint at {d}/nowhere"),
    (["checkpoint={d}"], 3, "{d}/latest holds 'hello', not a step directory name"),
]


@pytest.mark.parametrize(
    "args, code, fragment", GENERATE_CASES, ids=[" ".join(c[0]) for c in GENERATE_CASES]
)
def test_generate_refuses_in_one_line(tmp_path, capfd, args, code, fragment):
    (tmp_path / "latest").write_text("hello")
    args = [a.format(d=tmp_path) for a in args]
    where = [] if any(a.startswith("checkpoint=") for a in args) else [f"checkpoint={tmp_path}"]
    got, out, err = run_main(generate_main, ["prompt=x", *where, *args], capfd)
    assert_one_line(got, err, code, fragment.format(d=tmp_path))
    assert out == ""


def test_generate_refuses_a_training_override_given_twice(capfd):
    code, _, err = run_main(
        generate_main, ["prompt=x", "trainer.max_steps=3", "trainer.max_steps=4"], capfd
    )
    assert_one_line(code, err, 2, "trainer.max_steps is given twice")
