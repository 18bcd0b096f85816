"""tools/train_tokenizer.py, tools/preprocess_data.py, the stdlib corpus and build_datasets."""

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megatronish.data.build import build_datasets
from megatronish.data.indexed import IndexedDataset, IndexedDatasetWriter
from megatronish.data.stdlib_corpus import ensure_stdlib_corpus
from megatronish.data.tokenizer import load_tokenizer
from megatronish.testing.cli import load_tool

REPO = Path(__file__).resolve().parents[2]
VOCAB = 400


def _run_tool(name, *args):
    """Run ``tools/<name>``'s ``main`` in this process (the tools' command lines and their
    subprocess runs are covered by test_tool_inputs_data.py); returns what it printed."""
    tool = load_tool(name.removesuffix(".py"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tool.main([*map(str, args), *(["--no-progress"] * (name == "preprocess_data.py"))])
    assert code in (0, None), err.getvalue()[-3000:]
    return out.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small jsonl and txt corpus plus a tokenizer trained on both by the CLI."""
    tmp = tmp_path_factory.mktemp("tools")
    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = ["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(300)]

    def text(lines):
        return "\n".join(" ".join(rng.choice(words, size=10)) for _ in range(lines))

    records = [{"id": i, "text": text(3) + (" ünïcode ✓" if i % 7 == 0 else "")} for i in range(60)]
    (tmp / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp / "b.txt").write_text("def f(x):\n    return x  # tab\there\n" + text(40))
    _run_tool(
        "train_tokenizer.py",
        "--input",
        tmp / "a.jsonl",
        tmp / "b.txt",
        "--model-prefix",
        tmp / "tok",
        "--vocab-size",
        VOCAB,
        "--num-threads",
        2,
    )
    return SimpleNamespace(dir=tmp, records=records, model=str(tmp / "tok.model"))


def test_train_tokenizer_cli(corpus):
    tok = load_tokenizer(corpus.model)
    assert tok.vocab_size == VOCAB and tok.eod_id == 2
    sample = corpus.records[0]["text"] + "\n\tindented  code ✓"
    assert tok.decode(tok.encode(sample)) == sample


def test_preprocess_jsonl_matches_tokenizer(corpus):
    prefix = corpus.dir / "out" / "a"
    out = _run_tool(
        "preprocess_data.py",
        "--input",
        corpus.dir / "a.jsonl",
        "--tokenizer-model",
        corpus.model,
        "--output-prefix",
        prefix,
        "--num-proc",
        2,
    )
    assert "60 documents" in out and "tokens/s" in out
    tok = load_tokenizer(corpus.model)
    ds = IndexedDataset(str(prefix))
    assert ds.dtype == np.uint16 and len(ds) == len(corpus.records)
    for i, rec in enumerate(corpus.records):
        assert ds[i].tolist() == tok.encode(rec["text"]) + [tok.eod_id]
    assert sorted(os.listdir(prefix.parent)) == ["a.bin", "a.idx"]  # temp HF cache removed


def test_preprocess_txt_glob_without_eod(corpus):
    prefix = corpus.dir / "out" / "b"
    _run_tool(
        "preprocess_data.py",
        "--input",
        corpus.dir / "*.txt",
        "--tokenizer-model",
        corpus.model,
        "--output-prefix",
        prefix,
        "--no-append-eod",
    )
    tok = load_tokenizer(corpus.model)
    ds = IndexedDataset(str(prefix))
    assert len(ds) == 1
    assert ds[0].tolist() == tok.encode((corpus.dir / "b.txt").read_text())


def test_build_datasets_indexed_and_config_errors(corpus, tmp_path):
    prefix = str(tmp_path / "a")
    _run_tool(
        "preprocess_data.py",
        "--input",
        corpus.dir / "a.jsonl",
        "--tokenizer-model",
        corpus.model,
        "--output-prefix",
        prefix,
    )
    cfg = SimpleNamespace(source="indexed", prefix=prefix, tokenizer_model=corpus.model)
    train, valid, tok = build_datasets(cfg, seq_length=16, seed=0)
    assert tok.vocab_size == VOCAB and len(valid.documents) == 1
    assert train[0].shape == (17,) and valid[5].shape == (17,)

    with pytest.raises(ValueError, match="data.source"):
        build_datasets(SimpleNamespace(source="web"), 16, 0)
    with pytest.raises(ValueError, match="data.prefix is required"):
        build_datasets({"source": "indexed", "tokenizer_model": corpus.model}, 16, 0)
    with pytest.raises(FileNotFoundError, match="data.prefix"):
        build_datasets({**vars(cfg), "prefix": str(tmp_path / "nope")}, 16, 0)
    with pytest.raises(FileNotFoundError, match="data.tokenizer_model"):
        build_datasets({**vars(cfg), "tokenizer_model": str(tmp_path / "no.model")}, 16, 0)

    with IndexedDatasetWriter(str(tmp_path / "big"), np.uint16) as w:
        w.add_document(np.arange(VOCAB + 10))
    with pytest.raises(ValueError, match=f"token id {VOCAB + 9}.*vocab_size {VOCAB}"):
        build_datasets({**vars(cfg), "prefix": str(tmp_path / "big")}, 16, 0)


def test_stdlib_corpus_is_built_once_and_reused(tmp_path, capsys):
    cache = tmp_path / "cache"
    prefix, model = ensure_stdlib_corpus(str(cache), 512, 0.5)
    assert "building" in capsys.readouterr().out
    assert Path(model).is_file() and Path(prefix + ".bin").is_file()
    assert sorted(os.listdir(cache)) == [
        f"stdlib-py{sys.version_info[0]}{sys.version_info[1]}-v512-0.5mb"
    ]
    t0 = time.perf_counter()
    assert ensure_stdlib_corpus(str(cache), 512, 0.5) == (prefix, model)
    assert time.perf_counter() - t0 < 0.5
    assert capsys.readouterr().out == ""

    tok, ds = load_tokenizer(model), IndexedDataset(prefix)
    assert tok.vocab_size == 512 and 20 < len(ds) and ds.num_tokens > 100_000
    assert all(ds[i][-1] == tok.eod_id for i in range(len(ds)))
    assert tok.decode(ds[0][:-1]).startswith(('"""', "#", "import", "from", "'"))

    cfg = SimpleNamespace(
        cache_dir=str(cache), vocab_size=512, max_corpus_mb=0.5, valid_fraction=0.2
    )
    train, valid, tok2 = build_datasets(cfg, seq_length=64, seed=0)
    assert tok2.model_path == model and len(valid.documents) >= 1
    assert train[12345].shape == (65,)


def test_preprocess_mixed_formats_identical_for_any_worker_count(corpus, tmp_path):
    """jsonl, parquet, arrow and txt inputs in one run: documents in input order, and the same
    bytes with 1 and 2 workers; --output-per-input writes one dataset per input."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [r["text"] for r in corpus.records]
    table = pa.table({"text": texts[:25], "n": list(range(25))})
    pq.write_table(table, tmp_path / "c.parquet")
    with pa.ipc.new_stream(tmp_path / "d.arrow", table.schema) as w:
        w.write_table(pa.table({"text": texts[25:], "n": list(range(25, 60))}))
    inputs = [
        corpus.dir / "a.jsonl",
        tmp_path / "c.parquet",
        tmp_path / "d.arrow",
        corpus.dir / "b.txt",
    ]
    for workers in (1, 2):
        _run_tool(
            "preprocess_data.py",
            "--input",
            *inputs,
            "--tokenizer-model",
            corpus.model,
            "--output-prefix",
            tmp_path / f"w{workers}",
            "--workers",
            workers,
        )
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"w2{ext}").read_bytes()
    tok, ds = load_tokenizer(corpus.model), IndexedDataset(str(tmp_path / "w2"))
    want = [*texts, *texts, (corpus.dir / "b.txt").read_text()]
    assert len(ds) == len(want) == 121
    for i in (0, 59, 60, 84, 85, 119, 120):
        assert ds[i].tolist() == tok.encode(want[i]) + [tok.eod_id], i

    out = _run_tool(
        "preprocess_data.py",
        "--input",
        tmp_path / "*.parquet",
        tmp_path / "*.arrow",
        "--tokenizer-model",
        corpus.model,
        "--output-prefix",
        tmp_path / "per",
        "--output-per-input",
        "--workers",
        2,
    )
    assert "per_c.bin/.idx" in out and "per_d.bin/.idx" in out and "tokens/s" in out
    assert len(IndexedDataset(str(tmp_path / "per_c"))) == 25
    assert len(IndexedDataset(str(tmp_path / "per_d"))) == 35


def test_preprocess_refuses_unknown_inputs_and_clashing_outputs(corpus, tmp_path):
    from megatronish.data.preprocess import output_prefixes, resolve_inputs

    with pytest.raises(ValueError, match="matches no file"):
        resolve_inputs([str(tmp_path / "*.jsonl")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unsupported extension\(s\) \['.csv'\]"):
        resolve_inputs([str(tmp_path / "x.csv")])
    with pytest.raises(ValueError, match=r"several inputs are named \['a'\]"):
        output_prefixes(["d1/a.jsonl", "d2/a.jsonl"], "out", per_input=True)
    assert output_prefixes(["d1/a.jsonl", "d2/a.jsonl"], "out", per_input=False) == ["out"] * 2


def test_preprocess_keeps_document_order_across_many_chunks(corpus, tmp_path, monkeypatch):
    from megatronish.data import preprocess

    monkeypatch.setattr(preprocess, "CHUNK_DOCS", 7)  # 60 documents: 9 chunks, out of order
    files = [str(corpus.dir / "a.jsonl")]
    for workers in (1, 2):
        preprocess.preprocess(files, corpus.model, str(tmp_path / f"w{workers}"), workers=workers)
    assert (tmp_path / "w1.bin").read_bytes() == (tmp_path / "w2.bin").read_bytes()
    tok, ds = load_tokenizer(corpus.model), IndexedDataset(str(tmp_path / "w2"))
    assert [ds[i].tolist() for i in range(60)] == [
        tok.encode(r["text"]) + [tok.eod_id] for r in corpus.records
    ]
