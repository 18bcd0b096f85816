"""The closest valid names to a mistyped one (megatronish/config/did_you_mean.py): typos, names
of other trainers (Megatron-LM's flags as keys), keys put in the wrong section, group options,
the tools' flags and choices; and no suggestion where nothing is close. What the entry points
print with them is in test_tool_inputs_cli.py."""

import argparse

import pytest

from megatronish.config.cli_errors import OneLineArgumentParser, unknown_key_reason
from megatronish.config.did_you_mean import closest_keys, closest_names, schema_keys

KEYS = [
    ("trainer.max_step", ["trainer.max_steps"]),
    ("trainer.profile.step", ["trainer.profile.steps"]),
    ("model.moe.router.aux_loss", ["model.moe.router.aux_loss_coef"]),
    ("model.moe.topk", ["model.moe.top_k"]),
    ("model.layers", ["model.num_layers"]),
    ("trainer.global_batch", ["trainer.global_batch_size"]),
    # initials and synonyms
    ("optimizer.learning_rate", ["optimizer.lr"]),
    ("parallel.tensor_parallel", ["parallel.tp"]),
    ("parallel.pipeline_parallel", ["parallel.pp"]),
    ("parallel.sequence_parallel", ["parallel.sp"]),
    ("parallel.tensor_model_parallel_size", ["parallel.tp"]),
    ("trainer.train_iters", ["trainer.max_steps"]),
    ("model.num_heads", ["model.num_attention_heads"]),
    ("model.num_kv_heads", ["model.num_query_groups"]),
    ("checkpoint.save_interval", ["checkpoint.interval"]),
    ("checkpoint.save", ["checkpoint.dir"]),
    # another section, a section, a prefix of two keys
    ("trainer.lr", ["optimizer.lr"]),
    ("trainer.grad_clip", ["optimizer.grad_clip"]),
    ("modle", ["model"]),
    ("model.hidden", ["model.hidden_size", "model.hidden_dropout"]),
    # nothing close
    ("model.not_a_key", []),
    ("trainer.top_p", ["model.moe.top_k"]),  # by spelling; not parallel.tp by initials
    ("foo", []),
]


@pytest.mark.parametrize("typed, meant", KEYS, ids=[k for k, _ in KEYS])
def test_closest_keys(typed, meant):
    assert closest_keys(typed) == meant


def test_an_entry_points_options_are_offered_before_config_keys():
    extra = ["device", "device_memory_gb", "peak_tflops"]
    assert closest_keys("device_mem_gb", extra) == ["device_memory_gb"]
    assert closest_keys("peak_tflop", extra) == ["peak_tflops"]


def test_schema_keys_are_nested_and_include_sections():
    keys = schema_keys()
    assert {
        "model",
        "model.moe",
        "model.moe.router",
        "model.moe.router.aux_loss_coef",
        "trainer.profile.steps",
        "world_size",
    } <= set(keys)
    assert len(keys) == len(set(keys))


def test_group_options():
    options = ["gpt_125m", "gpt_1b", "gpt_1b_32k", "gpt_7b", "moe_1b_7b", "tiny", "tiny_gpt2"]
    assert closest_names("gpt1b", options) == ["gpt_1b"]
    assert closest_names("tiny_gtp2", options) == ["tiny_gpt2"]
    assert closest_names("llama", options) == []


def test_unknown_key_reason_says_what_to_do_without_a_suggestion():
    assert unknown_key_reason("trainer.max_step").startswith(
        "unknown key trainer.max_step: did you mean trainer.max_steps?"
    )
    assert "check the spelling; docs/config.md lists every key" in unknown_key_reason("foo.bar")


def _parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="tool.py")
    p.add_argument("--verify", action="store_true")
    p.add_argument("--max-rows", type=int)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    return p


ARGPARSE = [
    (["--verfy"], "unrecognized arguments: --verfy; did you mean --verify?"),
    (["--max-rws=3"], "unrecognized arguments: --max-rws=3; did you mean --max-rows?"),
    (["--dtype", "bf16"], "invalid choice: 'bf16'"),
    (["--dtype", "bf16"], "did you mean bfloat16?"),
    (["--nothing-like-it"], "unrecognized arguments: --nothing-like-it (see tool.py --help)"),
]


@pytest.mark.parametrize("argv, fragment", ARGPARSE)
def test_tools_suggest_the_closest_flag_or_choice(capsys, argv, fragment):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("invalid argument: ") and fragment in err


def test_a_flag_abbreviation_is_still_accepted():
    assert _parser().parse_args(["--ver"]) == argparse.Namespace(
        verify=True, max_rows=None, dtype=None
    )
