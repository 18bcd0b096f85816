"""Bad data inputs: damaged or mismatched .bin/.idx, a tokenizer that does not fit, missing paths.

Each is one clear error naming the file or value, on every rank of a job (exit code 3; a path
missing at validation time is a config error, exit code 2), never a hang or a garbage run.
"""

import contextlib
import io
import os
import re
import shutil
import struct

import numpy as np
import pytest

from megatronish.config.compose import load_config
from megatronish.config.validate import config_errors
from megatronish.data.indexed import HEADER_SIZE, IndexedDataset, IndexedDatasetWriter
from megatronish.data.sentencepiece_tokenizer import train_sentencepiece
from megatronish.testing.multiproc import run_world
from megatronish.train import EXIT_CONFIG, EXIT_DATA, main_with_config

VOCAB = 300
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.seq_length=16",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=4",
    "trainer.max_steps=1",
    "trainer.eval_interval=0",
    "logging.wandb=false",
    "trainer.device=cpu",
    "data=indexed",
    "checkpoint.dir=null",
]


def write_docs(prefix, docs):
    with IndexedDatasetWriter(str(prefix), np.uint16) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A 300-token sentencepiece model and a 40-document dataset of ids below 300."""
    tmp = tmp_path_factory.mktemp("faults_data")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), size=rng.integers(2, 7))) for _ in range(200)]
    lines = [" ".join(rng.choice(words, size=12)) for _ in range(400)]
    (tmp / "text.txt").write_text("\n".join(lines))
    model = train_sentencepiece([str(tmp / "text.txt")], str(tmp / "tok"), VOCAB, num_threads=1)
    docs = [rng.integers(3, VOCAB, size=int(rng.integers(20, 60))) for _ in range(40)]
    return tmp, model, write_docs(tmp / "good", docs)


def spoiled(data, tmp_path, how):
    """A copy of the good dataset spoiled ``how``; returns its prefix."""
    _, _, good = data
    prefix = str(tmp_path / "ds")
    for ext in (".bin", ".idx"):
        shutil.copy(good + ext, prefix + ext)
    how(prefix)
    return prefix


def truncate_bin(prefix):
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 2)


def bin_of_another_dataset(prefix):
    write_docs(prefix + "_other", [np.arange(3, 50)] * 3)
    os.replace(prefix + "_other.bin", prefix + ".bin")


def break_document_index(prefix):
    with open(prefix + ".idx", "r+b") as f:
        f.seek(-8, os.SEEK_END)  # the document index ends the file: its last entry
        f.write(struct.pack("<q", 7))


def ids_beyond_vocab(prefix):
    write_docs(prefix, [np.arange(3, 40), np.array([5, VOCAB + 50, 6]), np.arange(10, 90)])


# -- each detection ---------------------------------------------------------------------------


def test_truncated_bin_names_both_files(data, tmp_path):
    prefix = spoiled(data, tmp_path, truncate_bin)
    with pytest.raises(ValueError, match=f"{prefix}.bin has .* bytes but {prefix}.idx describes"):
        IndexedDataset(prefix)


def test_bin_of_another_dataset_is_refused(data, tmp_path):
    prefix = spoiled(data, tmp_path, bin_of_another_dataset)
    with pytest.raises(ValueError, match="truncated or does not belong to this .idx"):
        IndexedDataset(prefix)


def test_document_index_that_does_not_span_the_sequences(data, tmp_path):
    prefix = spoiled(data, tmp_path, break_document_index)
    with pytest.raises(ValueError, match=rf"{prefix}.idx is corrupt: .*\[0, ..., 7\]"):
        IndexedDataset(prefix)


def test_document_index_that_goes_backwards(tmp_path):
    prefix = write_docs(tmp_path / "ds", [[1, 2], [3], [4, 5]])
    with open(prefix + ".idx", "r+b") as f:
        f.seek(-16, os.SEEK_END)  # document index [0, 1, 2, 3] -> [0, 1, 0, 3]
        f.write(struct.pack("<q", 0))
    with pytest.raises(ValueError, match="a document index that goes backwards"):
        IndexedDataset(prefix)


def test_idx_shorter_than_its_header(data, tmp_path):
    prefix = spoiled(data, tmp_path, lambda p: os.truncate(p + ".idx", 20))
    with pytest.raises(ValueError, match=f"{prefix}.idx is truncated: 20 bytes, shorter than"):
        IndexedDataset(prefix)
    os.truncate(prefix + ".idx", 0)
    with pytest.raises(ValueError, match=f"shorter than the {HEADER_SIZE}-byte header"):
        IndexedDataset(prefix)


def test_model_vocabulary_smaller_than_the_tokenizer_is_a_config_error():
    cfg = load_config([*SMALL, "model.vocab_size=256"])
    errors = config_errors(cfg, 1, vocab_size=VOCAB)
    assert f"the tokenizer has {VOCAB} tokens but model.vocab_size=256" in " ".join(errors)


# -- every rank of a job stops with the message ---------------------------------------------------


def train_main(rank, world, cfg):
    """``python -m megatronish.train`` on this rank: its exit code and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main_with_config(cfg)
    return code, err.getvalue()


CASES = {
    "truncated-bin": (truncate_bin, [], EXIT_DATA, r"ds.bin has \d+ bytes but .*ds.idx describes"),
    "bin-of-another-dataset": (
        bin_of_another_dataset,
        [],
        EXIT_DATA,
        "does not belong to this .idx",
    ),
    "corrupt-idx": (break_document_index, [], EXIT_DATA, "ds.idx is corrupt"),
    "missing-bin": (lambda p: os.remove(p + ".bin"), [], EXIT_DATA, r"ds.bin does not exist"),
    "ids-beyond-vocab": (
        ids_beyond_vocab,
        [],
        EXIT_DATA,
        f"contains token id {VOCAB + 50} but tokenizer .* has vocab_size {VOCAB}",
    ),
    "model-vocab-too-small": (
        lambda p: None,
        ["model.vocab_size=256"],
        EXIT_CONFIG,
        f"the tokenizer has {VOCAB} tokens but model.vocab_size=256",
    ),
    "missing-prefix": (
        lambda p: [os.remove(p + e) for e in (".bin", ".idx")],
        [],
        EXIT_CONFIG,
        r"ds.idx does not exist",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_exits_with_the_message(data, tmp_path, case):
    spoil, extra, code, message = CASES[case]
    _, model, _ = data
    prefix = spoiled(data, tmp_path, spoil)
    cfg = load_config(
        [
            *SMALL,
            f"data.prefix={prefix}",
            f"data.tokenizer_model={model}",
            f"out_dir={tmp_path / 'out'}",
            *extra,
        ]
    )
    results = run_world(train_main, 2, cfg, timeout=120)
    for rank, (exit_code, stderr) in enumerate(results):
        assert exit_code == code, (rank, stderr)
        assert re.search(message, stderr), (rank, stderr)
        assert "Traceback" not in stderr
