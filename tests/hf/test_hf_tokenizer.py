"""Hugging Face tokenizers (tokenizer.json) beside sentencepiece: loading by path, special
tokens, preprocessing, the tokenizer written beside an export, imports that bring their own.

Tokenizers are trained here on a few strings (no downloads): a GPT-2 style byte-level BPE with
``tokenizers`` and a lossless sentencepiece model with tools/train_tokenizer.py's settings.
Exports are made from checkpoints tools/import_hf.py writes from tiny random HF models.
"""

import contextlib
import io
import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from megatronish.config.compose import load_config
from megatronish.config.data_rules import data_errors
from megatronish.data.build import build_datasets
from megatronish.data.hf_tokenizer import HFTokenizer
from megatronish.data.indexed import IndexedDataset
from megatronish.data.sentencepiece_tokenizer import SentencePieceTokenizer, train_sentencepiece
from megatronish.data.tokenizer import load_tokenizer
from megatronish.testing.cli import assert_one_line, load_tool, run_main

EOT = "<|endoftext|>"
SPM_VOCAB = 360  # the sentencepiece model's, and the imported llama's
# Code with indentation, tabs, blank lines and CRLF; prose; accents, CJK and emoji.
SAMPLES = [
    "def f(x):\n    return x  # tab\there\n\n\n        pass\r\n",
    "The quick brown fox jumps over the lazy dog. Twice!",
    "  two leading spaces and    four inside",
    "ünïcode ✓ 日本語 😀",
    "x = [1, 22, 333]; y = 4.5e-6",
]
TRAIN_TEXTS = SAMPLES * 4 + [
    "import os\nimport sys\n\nclass A:\n    def __init__(self):\n        self.x = 1\n",
    "for i in range(10):\n\tprint(i, i * i)\n",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
]
PREPROCESS = load_tool("preprocess_data")
EXPORT, IMPORT = load_tool("export_hf"), load_tool("import_hf")


def byte_level_bpe(special=(EOT,), vocab_size: int = 400) -> tokenizers.Tokenizer:
    """A GPT-2 style tokenizer (byte-level BPE: every text round-trips) trained on
    :data:`TRAIN_TEXTS`, with ``special`` tokens first."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXTS, trainer)
    return tok


def hf_dir(path: Path, tok: tokenizers.Tokenizer, **files: dict) -> Path:
    """``path/tokenizer.json`` of ``tok`` plus JSON ``files`` (``tokenizer_config={...}``)."""
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    for name, value in files.items():
        (path / f"{name}.json").write_text(json.dumps(value))
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_tokenizer")


@pytest.fixture(scope="module")
def gpt2_tok(work) -> Path:
    """A GPT-2 style tokenizer directory: tokenizer.json and a tokenizer_config.json naming
    <|endoftext|> as bos and eos (as GPT-2's special tokens do)."""
    return hf_dir(
        work / "gpt2_tok",
        byte_level_bpe(),
        tokenizer_config={"bos_token": EOT, "eos_token": EOT, "model_max_length": 32},
    )


@pytest.fixture(scope="module")
def spm_model(work) -> str:
    """A lossless sentencepiece model (tools/train_tokenizer.py's settings)."""
    (work / "spm.txt").write_text("\n".join(TRAIN_TEXTS * 3))
    return train_sentencepiece([str(work / "spm.txt")], str(work / "spm"), SPM_VOCAB, num_threads=1)


# -- loading ------------------------------------------------------------------------------------


def test_the_path_picks_the_tokenizer(gpt2_tok, spm_model):
    from_dir, from_file = (
        load_tokenizer(str(gpt2_tok)),
        load_tokenizer(str(gpt2_tok / "tokenizer.json")),
    )
    assert isinstance(from_dir, HFTokenizer) and isinstance(from_file, HFTokenizer)
    assert isinstance(load_tokenizer(spm_model), SentencePieceTokenizer)
    for text in SAMPLES:
        assert from_dir.encode(text) == from_file.encode(text)
    assert from_dir.vocab_size == from_file.vocab_size == 400


def test_hf_encode_decode_round_trip_and_end_of_document(gpt2_tok):
    tok = load_tokenizer(str(gpt2_tok))
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids and tok.decode(ids) == text
    eot = tokenizers.Tokenizer.from_file(str(gpt2_tok / "tokenizer.json")).token_to_id(EOT)
    assert tok.eod_id == eot == 0
    assert tok.special_token_ids() == {"bos_token_id": eot, "eos_token_id": eot}
    assert tok.decode([tok.eod_id]) == EOT
    batch = tok.encode_batch(SAMPLES)
    assert batch == [tok.encode(t) for t in SAMPLES] == tok.encode_batch(SAMPLES, num_threads=2)
    # Text that spells the special token is text, as in a sentencepiece model: documents end
    # only where preprocessing appends the id.
    assert tok.eod_id not in tok.encode(f"a{EOT}b") and tok.decode(tok.encode(EOT)) == EOT


@pytest.mark.parametrize(
    "files, eos",
    [
        ({"tokenizer_config": {"eos_token": {"content": "<pad>", "special": True}}}, "<pad>"),
        ({"special_tokens_map": {"eos_token": "<pad>"}}, "<pad>"),
        ({"generation_config": {"eos_token_id": [1, 0]}}, 1),
        ({"config": {"eos_token_id": 1, "bos_token_id": 0}}, 1),
        ({"tokenizer_config": {"model_max_length": 8}, "config": {"eos_token_id": 1}}, 1),
        ({}, EOT),  # no file names it: the usual end-of-text name
    ],
    ids=[
        "tokenizer_config",
        "special_tokens_map",
        "generation_config-list",
        "config",
        "config-after-a-config-without-it",
        "by-name",
    ],
)
def test_the_eos_token_is_found_in_each_companion_file(tmp_path, files, eos):
    tok = byte_level_bpe(special=(EOT, "<pad>"))
    loaded = HFTokenizer(str(hf_dir(tmp_path, tok, **files)))
    want = eos if isinstance(eos, int) else tok.token_to_id(eos)
    assert loaded.eod_id == loaded.special_token_ids()["eos_token_id"] == want


def test_tokenizer_errors_are_one_line_with_the_fix(tmp_path, spm_model):
    word_level = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    no_eos = hf_dir(tmp_path / "no_eos", word_level)
    with pytest.raises(
        ValueError,
        match=r"names no eos \(end-of-document\) token.*write "
        rf"{no_eos}/tokenizer_config.json with {{\"eos_token\"",
    ):
        load_tokenizer(str(no_eos))
    unknown = hf_dir(tmp_path / "unknown", word_level, tokenizer_config={"eos_token": "</s>"})
    with pytest.raises(ValueError, match="names eos_token '</s>', which .* does not have"):
        load_tokenizer(str(unknown))
    out_of_range = hf_dir(tmp_path / "range", word_level, config={"eos_token_id": 7})
    with pytest.raises(ValueError, match=r"names eos_token_id=7, which .* \(2 ids\) does not have"):
        load_tokenizer(str(out_of_range))
    other_bos = hf_dir(
        tmp_path / "bos",
        word_level,
        tokenizer_config={"pad_token": "<pad>"},
        config={"eos_token_id": 1, "bos_token_id": 7},
    )
    assert load_tokenizer(str(other_bos)).special_token_ids() == {"eos_token_id": 1}
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="is a directory without a tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))
    shutil.copy(spm_model, tmp_path / "empty" / "tokenizer.model")
    with pytest.raises(FileNotFoundError, match=f"give {tmp_path}/empty/tokenizer.model"):
        load_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "broken.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match="broken.json is not a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path / "broken.json"))
    with pytest.raises(FileNotFoundError, match="nope.json does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_config_rules_take_a_directory_only_with_a_tokenizer_json(gpt2_tok, tmp_path):
    base = ["data=indexed", f"data.prefix={tmp_path / 'ds'}"]
    (tmp_path / "ds.idx").write_bytes(b"")

    def errors(model):
        return " ".join(data_errors(load_config([*base, f"data.tokenizer_model={model}"])))

    assert "tokenizer" not in errors(gpt2_tok)
    assert "tokenizer" not in errors(gpt2_tok / "tokenizer.json")
    assert f"{tmp_path} is a directory without a tokenizer.json" in errors(tmp_path)


# -- preprocessing and data ---------------------------------------------------------------------


def test_preprocess_with_an_hf_tokenizer_gives_its_ids(gpt2_tok, tmp_path, capfd):
    docs = [*SAMPLES, f"a literal {EOT} stays text"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = tmp_path / "out" / "docs"
    code, out, err = run_main(
        PREPROCESS.main,
        [
            "--input",
            tmp_path / "docs.jsonl",
            "--tokenizer-model",
            gpt2_tok,
            "--output-prefix",
            prefix,
            "--no-progress",
        ],
        capfd,
    )
    assert code == 0 and f"{len(docs)} documents" in out, err
    tok, ds = load_tokenizer(str(gpt2_tok)), IndexedDataset(str(prefix))
    assert ds.dtype == np.uint16 and len(ds) == len(docs)
    for i, text in enumerate(docs):
        assert ds[i].tolist() == tok.encode(text) + [tok.eod_id]
        assert tok.eod_id not in ds[i].tolist()[:-1]

    train, _, built = build_datasets(
        SimpleNamespace(source="indexed", prefix=str(prefix), tokenizer_model=str(gpt2_tok)), 4, 0
    )
    assert isinstance(built, HFTokenizer) and built.vocab_size == 400 and len(train[0]) == 5


def test_preprocess_refuses_a_directory_without_tokenizer_json_and_a_tokenizer_without_eos(
    tmp_path, capfd
):
    (tmp_path / "docs.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "empty").mkdir()
    args = ["--input", tmp_path / "docs.jsonl", "--output-prefix", tmp_path / "o" / "x"]
    code, _, err = run_main(
        PREPROCESS.main, [*args, "--tokenizer-model", tmp_path / "empty"], capfd
    )
    assert_one_line(code, err, 2, "--tokenizer-model: ")
    assert "is a directory without a tokenizer.json" in err
    word_level = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    no_eos = hf_dir(tmp_path / "no_eos", word_level)
    code, _, err = run_main(PREPROCESS.main, [*args, "--tokenizer-model", no_eos], capfd)
    assert_one_line(code, err, 3, "names no eos (end-of-document) token")
    assert not (tmp_path / "o").exists() or os.listdir(tmp_path / "o") == []


# -- export and import --------------------------------------------------------------------------


def tiny_hf_model(path: Path, arch: str, vocab: int, tokenizer: Path | None = None) -> Path:
    """A random 1-layer HF llama or gpt2 of ``vocab`` ids (saved by transformers), with
    ``tokenizer``'s files beside it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=vocab,
                n_embd=32,
                n_layer=1,
                n_head=4,
                n_positions=32,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=32,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
    model.save_pretrained(path)
    if tokenizer is not None:
        shutil.copytree(tokenizer, path, dirs_exist_ok=True)
    return path


def transformers_ids(out_dir, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out_dir)).encode(text, add_special_tokens=False)


def imported(work: Path, name: str, arch: str, vocab: int, tokenizer=None) -> tuple[str, str]:
    """``(HF dir, checkpoint)``: a tiny HF model and its tools/import_hf.py import (cached)."""
    ckpt = work / f"{name}-ckpt"
    if not ckpt.exists():
        quiet = io.StringIO()  # transformers' progress bars, the import's lines
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            tiny_hf_model(work / name, arch, vocab, tokenizer)
            assert IMPORT.main([str(work / name), str(ckpt)]) == 0
    return str(work / name), str(ckpt)


def test_export_writes_a_sentencepiece_tokenizer_transformers_encodes_alike(work, spm_model, capfd):
    _, ckpt = imported(work, "llama", "llama", SPM_VOCAB)
    out = work / "export-spm"
    code, printed, err = run_main(EXPORT.main, [ckpt, out, "--tokenizer", spm_model], capfd)
    assert code == 0, err
    line = printed.splitlines()[-1]
    assert re.fullmatch(
        r"wrote tokenizer: tokenizer.json, tokenizer.model, tokenizer_config.json \(sentencepiece "
        rf"{re.escape(spm_model)}, converted: the same ids on \d+ probe texts\)",
        line,
    ), line
    ours = load_tokenizer(spm_model)
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(out))
    assert (theirs.eos_token_id, theirs.bos_token_id, theirs.unk_token_id) == (2, 1, 0)
    for text in SAMPLES:
        ids = ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ids, text
        assert theirs(text)["input_ids"] == ids  # no BOS: the run's data has none
        assert theirs.decode(ids) == text
    reloaded = load_tokenizer(str(out))  # an export is a tokenizer directory too
    assert all(reloaded.encode(t) == ours.encode(t) for t in SAMPLES) and reloaded.eod_id == 2


def test_an_imported_model_keeps_its_hf_tokenizer_through_export_and_generation(
    work, gpt2_tok, capfd
):
    hf, ckpt = imported(work, "gpt2", "gpt2", 400, gpt2_tok)
    code, printed, err = run_main(IMPORT.main, [hf, work / "gpt2-again", "--force"], capfd)
    assert code == 0 and err == "", err
    assert f"--tokenizer-model {hf}" in printed and f"data.tokenizer_model={hf}" in printed
    assert "end-of-document id 0" in printed

    out = work / "export-gpt2"
    (out).mkdir()
    (out / "vocab.json").write_text("{}")  # an earlier export's file: removed
    code, printed, err = run_main(EXPORT.main, [ckpt, out], capfd)
    assert code == 0 and err == "", err
    assert printed.splitlines()[-1] == (
        f"wrote tokenizer: tokenizer.json, tokenizer_config.json (copied from "
        f"{os.path.abspath(hf)}/tokenizer.json)"
    )
    assert sorted(os.listdir(out)) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == EOT
    ours = load_tokenizer(str(gpt2_tok))
    for text in SAMPLES:
        assert transformers_ids(out, text) == ours.encode(text), text

    from megatronish.generate.cli import main as generate

    code, printed, err = run_main(
        generate, [f"checkpoint={ckpt}", "prompt=def f(x):", "max_new_tokens=4"], capfd
    )
    assert code == 0 and printed.startswith("def f(x):"), err


def test_import_warns_about_a_tokenizer_larger_than_the_model(work, gpt2_tok, capfd):
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        hf = tiny_hf_model(work / "gpt2-small-vocab", "gpt2", SPM_VOCAB, gpt2_tok)
    code, printed, err = run_main(IMPORT.main, [hf, work / "gpt2-small-vocab-ckpt"], capfd)
    assert_one_line(code, err, 0, f"has 400 tokens, more than the model's vocabulary ({SPM_VOCAB})")
    assert "data tokenized like the HF model" in printed and "tokenizer_model" not in printed


def test_export_warns_when_the_runs_tokenizer_is_gone_and_refuses_a_wrong_one(
    work, gpt2_tok, spm_model, capfd
):
    _, ckpt = imported(work, "llama", "llama", SPM_VOCAB)  # an HF dir without a tokenizer
    out = work / "export-none"
    out.mkdir(exist_ok=True)
    (out / "tokenizer.json").write_text("{}")  # an earlier export's: not this model's
    code, printed, err = run_main(EXPORT.main, [ckpt, out], capfd)
    assert code == 0 and "wrote tokenizer" not in printed, err
    assert err.strip() == (
        "warning: no tokenizer written: the checkpoint's config names no "
        "tokenizer; pass --tokenizer PATH to write one"
    )
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]

    code, _, err = run_main(EXPORT.main, [ckpt, work / "x", "--tokenizer", gpt2_tok], capfd)
    assert_one_line(code, err, 2, f"has more tokens than the model's vocabulary ({SPM_VOCAB})")
    code, _, err = run_main(EXPORT.main, [ckpt, work / "x", "--tokenizer", work / "no"], capfd)
    assert_one_line(
        code, err, 2, f"--tokenizer {work}/no: tokenizer model {work}/no does not exist"
    )


def test_a_sentencepiece_model_the_conversion_cannot_reproduce_is_written_unconverted(
    work, spm_model, capfd
):
    """sentencepiece's defaults (NFKC, a dummy prefix, extra whitespace removed) are not what
    the converter writes: the export copies tokenizer.model for transformers to convert."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=str(work / "spm.txt"),
        model_prefix=str(work / "dflt"),
        vocab_size=SPM_VOCAB,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
        num_threads=1,
    )
    _, ckpt = imported(work, "llama", "llama", SPM_VOCAB)
    out = work / "export-dflt"
    code, printed, err = run_main(
        EXPORT.main, [ckpt, out, "--tokenizer", work / "dflt.model"], capfd
    )
    assert code == 0, err
    assert re.search(
        r"tokenizer: tokenizer.model, tokenizer_config.json \(.* not converted to "
        r"tokenizer.json: that would encode \d+ of \d+ probe texts differently",
        printed,
    )
    assert not (out / "tokenizer.json").exists()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "LlamaTokenizer" and config["add_prefix_space"] is True
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(out)).eos_token == "</s>"


# -- continued pretraining with the imported model's own tokenizer -------------------------------


def train_main(rank, world, cfg):
    """``python -m megatronish.train`` on this rank: its exit code and stderr."""
    from megatronish.train import main_with_config

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main_with_config(cfg)
    return code, err.getvalue()


@pytest.mark.slow
def test_pretraining_continues_from_an_imported_gpt2_with_its_tokenizer(
    work, gpt2_tok, tmp_path, capfd
):
    """The import's printed commands, run: its tokenizer preprocesses the data, training resumes
    from the import on it, the checkpoints record it, and their export carries it."""
    from megatronish.checkpoint.format import read_metadata, resolve_step_dir
    from megatronish.hf.common import override_args
    from megatronish.testing.multiproc import run_world

    hf, ckpt = imported(work, "gpt2", "gpt2", 400, gpt2_tok)
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(TRAIN_TEXTS, size=12)) for _ in range(40)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    code, _, err = run_main(
        PREPROCESS.main,
        [
            "--input",
            tmp_path / "docs.jsonl",
            "--tokenizer-model",
            hf,
            "--output-prefix",
            tmp_path / "docs",
            "--no-progress",
        ],
        capfd,
    )
    assert code == 0, err

    model_cfg = read_metadata(resolve_step_dir(ckpt)).config["model"]
    cfg = load_config(
        [
            *override_args(model_cfg),
            f"checkpoint.resume={ckpt}",
            "data=indexed",
            f"data.prefix={tmp_path / 'docs'}",
            f"data.tokenizer_model={hf}",
            "trainer.micro_batch_size=2",
            "trainer.global_batch_size=4",
            "trainer.max_steps=2",
            "trainer.eval_interval=0",
            "logging.wandb=false",
            "trainer.device=cpu",
            f"out_dir={tmp_path / 'run'}",
            "scheduler.warmup_steps=1",
        ]
    )
    [(exit_code, stderr)] = run_world(train_main, 1, cfg, timeout=300)
    assert exit_code == 0, stderr
    meta = read_metadata(resolve_step_dir(str(tmp_path / "run" / "checkpoints")))
    assert meta.step == 2 and meta.config["data"]["tokenizer_model"] == hf
    assert meta.tokenizer == {"bos_token_id": 0, "eos_token_id": 0}

    out = tmp_path / "export"
    code, printed, err = run_main(EXPORT.main, [tmp_path / "run" / "checkpoints", out], capfd)
    assert code == 0 and f"(copied from {hf}/tokenizer.json)" in printed, err
    ours = load_tokenizer(hf)
    assert all(transformers_ids(out, t) == ours.encode(t) for t in SAMPLES)
