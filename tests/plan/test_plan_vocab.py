"""The vocabulary the planner plans with, where it comes from, and that the planner reads no
data (pure: no processes; one small tokenizer trained in this process)."""

import numpy as np
import pytest

from megatronish.config.compose import load_config
from megatronish.data.sentencepiece_tokenizer import train_sentencepiece
from megatronish.plan.cli import main as plan_main
from megatronish.plan.rules import planning_errors
from megatronish.plan.vocab import planned_vocab

TINY = ["+experiment=tiny", "world_size=1", "device_memory_gb=8"]
INDEXED = ["data=indexed", "data.prefix=/nowhere/corpus"]  # no such dataset: not read


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A 300-piece sentencepiece model."""
    tmp = tmp_path_factory.mktemp("vocab")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), size=rng.integers(2, 7))) for _ in range(200)]
    (tmp / "text.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)))
    return train_sentencepiece([str(tmp / "text.txt")], str(tmp / "tok"), 300, num_threads=1)


def _vocab(overrides):
    return planned_vocab(load_config(["+experiment=tiny", *overrides]))


def test_each_source_of_the_vocabulary_is_named(tokenizer):
    own = _vocab(["model.vocab_size=1000", *INDEXED, f"data.tokenizer_model={tokenizer}"])
    assert (own.size, own.padded, own.source, own.tokenizer) == (
        1000,
        1024,
        "model.vocab_size",
        300,
    )
    read = _vocab([*INDEXED, f"data.tokenizer_model={tokenizer}"])
    assert (read.size, read.padded) == (300, 384)
    assert read.source == f"the tokenizer data.tokenizer_model={tokenizer}"
    stdlib = _vocab(["data.vocab_size=512"])
    assert (stdlib.size, stdlib.source) == (
        512,
        "data.vocab_size, the tokenizer the built-in corpus trains",
    )
    assumed = _vocab([*INDEXED, "data.vocab_size=32000"])
    assert assumed.size == 32000 and "data.vocab_size assumed, no data.tokenizer_model" in (
        assumed.source
    )
    assert "built-in corpus's default" not in assumed.source
    default = _vocab(INDEXED)  # 4096: the built-in corpus's size, rarely a corpus's
    assert default.size == 4096 and "the built-in corpus's default" in default.source
    later = _vocab([*INDEXED, "data.tokenizer_model=/nowhere/tok.model"])
    assert "data.tokenizer_model=/nowhere/tok.model does not exist yet" in later.source


def test_the_plan_and_the_advice_print_the_vocabulary(capsys):
    assert plan_main([*TINY, *INDEXED, "data.vocab_size=32000"]) == 0
    out = capsys.readouterr().out
    assert "vocab: 32000 (data.vocab_size assumed, no data.tokenizer_model), padded to 32000" in out
    advise = [
        "+experiment=tiny",
        "world_size=2",
        "device_memory_gb=8",
        "peak_tflops=1",
        "advise=true",
        "top=2",
        "model.vocab_size=1000",
    ]
    assert plan_main(advise) == 0
    out = capsys.readouterr().out
    assert out.startswith("vocab: 1000 (model.vocab_size), padded to 1024 (a multiple of 128")


def test_the_planner_checks_the_rules_but_not_the_data(tokenizer, capsys):
    cfg = load_config(["+experiment=tiny", *INDEXED])
    assert planning_errors(cfg, 1)[0] == []  # the trainer would refuse the missing dataset
    bad = load_config(["+experiment=tiny", *INDEXED, "parallel.tp=3"])
    assert any("parallel.tp=3" in e for e in planning_errors(bad, 3)[0])
    small = ["model.vocab_size=200", *INDEXED, f"data.tokenizer_model={tokenizer}"]
    errors, vocab = planning_errors(load_config(["+experiment=tiny", *small]), 1)
    assert vocab is None and "the tokenizer has 300 tokens but model.vocab_size=200" in errors[0]
    assert plan_main([*TINY, *small]) == 2
    assert "model.vocab_size=200" in capsys.readouterr().err
