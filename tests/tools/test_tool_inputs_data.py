"""Bad input to the data tools (tools/preprocess_data.py, tools/train_tokenizer.py) and the blend
index cache: exit 2 for a bad argument, 3 for bad data, one line on stderr naming the value and
the fix, never a traceback, nothing half-written published.

Each matrix calls the tool's ``main(argv)`` in this process; one real subprocess per tool runs
under a file size limit (RLIMIT_FSIZE: the kernel refuses the write with EFBIG, as a full disk
refuses it with ENOSPC).
"""

import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import megatronish.data.blend as blend_module
from megatronish.data import preprocess
from megatronish.data.blend import blend_indices, cached_blend_indices
from megatronish.data.indexed import IndexedDataset, IndexedDatasetWriter
from megatronish.data.sentencepiece_tokenizer import train_sentencepiece
from megatronish.testing.cli import assert_one_line, load_tool, run_main

REPO = Path(__file__).resolve().parents[2]
WORDS = [a + b + c for a in "abcdefgh" for b in "aeiou" for c in "klmnst"]


PREPROCESS, TOKENIZER = load_tool("preprocess_data"), load_tool("train_tokenizer")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tokenizer and one small file per kind of good and bad input, in one directory."""
    d = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(0)
    text = "\n".join(" ".join(rng.choice(WORDS, 12)) for _ in range(200))
    (d / "ok.txt").write_text(text)
    model = train_sentencepiece([str(d / "ok.txt")], str(d / "tok"), 300, num_threads=1)
    (d / "junk.model").write_bytes(b"not a sentencepiece model")
    lines = {
        "ok.jsonl": [{"text": "abc def"}, {"text": "ghi"}],
        "number.jsonl": [{"text": 5}],
        "list.jsonl": [{"text": ["a", "b"]}],
        "missing.jsonl": [{"text": "abc"}, {"other": "x"}],
        "null.jsonl": [{"text": None}],
    }
    for name, rows in lines.items():
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "empty.jsonl").write_bytes(b"")
    (d / "empty.txt").write_bytes(b"")
    (d / "blank.jsonl").write_text("\n\n\n")
    (d / "broken.jsonl").write_text('{"text": "abc"}\nnot json\n')
    (d / "binary.txt").write_bytes(b"\xff\xfe\x00garbage\x80\n")
    (d / "binary.jsonl").write_bytes(b'{"text": "a"}\n\xff\xfe\n')
    (d / "table.parquet").write_bytes(b"PAR1")
    (d / "adir.jsonl").mkdir()
    (d / "afile").write_text("x")
    return d, model


# -- tools/preprocess_data.py -------------------------------------------------------------------

# (input file, extra arguments, output prefix (relative), exit code, fragment of the line)
PREPROCESS_CASES = [
    ("empty.jsonl", [], "o/x", 3, "empty.jsonl is empty (0 bytes): nothing to tokenize"),
    ("empty.txt", [], "o/x", 3, "empty.txt is empty (0 bytes)"),
    ("number.jsonl", [], "o/x", 3, "number.jsonl: row 1 has 'text' = 5 (int), not a string"),
    ("list.jsonl", [], "o/x", 3, "row 1 has 'text' = ['a', 'b'] (list), not a string"),
    ("missing.jsonl", [], "o/x", 3, "missing.jsonl: row 2 has no 'text' value (missing or null)"),
    ("null.jsonl", [], "o/x", 3, "row 1 has no 'text' value"),
    ("blank.jsonl", [], "o/x", 3, "blank.jsonl holds no records"),
    ("broken.jsonl", [], "o/x", 3, "cannot read"),
    ("binary.txt", [], "o/x", 3, "binary.txt as text ('utf-8' codec can't decode"),
    (
        "ok.jsonl",
        ["--json-key", "body"],
        "o/x",
        3,
        "no column 'body' (has ['text']); use --json-key",
    ),
    ("adir.jsonl", [], "o/x", 2, "adir.jsonl is a directory; give its files"),
    ("nothing*.jsonl", [], "o/x", 2, "matches no file"),
    (
        "table.parquet",
        ["--tokenizer-model", "{d}/junk.model"],
        "o/x",
        3,
        "junk.model is not a valid sentencepiece model",
    ),
    (
        "ok.jsonl",
        ["--tokenizer-model", "{d}/none.model"],
        "o/x",
        2,
        "--tokenizer-model: tokenizer model {d}/none.model does not exist",
    ),
    ("ok.jsonl", [], "o/", 2, "has no file name part: it would write {d}/o/.bin as a hidden file"),
    ("ok.jsonl", [], "afile/x", 2, "{d}/afile is a file, not a directory"),
    ("ok.jsonl", ["--workers", "0"], "o/x", 2, "--workers 0 must be >= 1"),
    ("ok.jsonl", ["--workers", "x"], "o/x", 2, "invalid int value: 'x'"),
]


@pytest.mark.parametrize(
    "name, extra, out, code, fragment",
    PREPROCESS_CASES,
    ids=[f"{c[0]} {' '.join(c[1])} {c[2]}" for c in PREPROCESS_CASES],
)
def test_preprocess_refuses(files, capfd, name, extra, out, code, fragment):
    d, model = files
    extra = [a.format(d=d) for a in extra]
    argv = [
        "--input",
        d / name,
        "--tokenizer-model",
        model,
        *extra,
        "--output-prefix",
        f"{d}/{out}",
        "--no-progress",
    ]
    got, _, err = run_main(PREPROCESS.main, argv, capfd)
    assert_one_line(got, err, code, fragment.format(d=d))
    assert not (d / "o").exists() or not os.listdir(d / "o")  # nothing written, not even a tmp


def test_preprocess_writes_a_good_input_and_returns_0(files, capfd):
    d, model = files
    argv = [
        "--input",
        d / "ok.jsonl",
        "--tokenizer-model",
        model,
        "--output-prefix",
        d / "good" / "x",
        "--no-progress",
    ]
    code, out, err = run_main(PREPROCESS.main, argv, capfd)
    assert code == 0 and "2 documents" in out, err
    assert len(IndexedDataset(str(d / "good" / "x"))) == 2


def _read_only(monkeypatch, directory: Path) -> None:
    """Files can no longer be created in ``directory`` (as on a read-only mount; chmod does
    not stop root, which runs these tests in some containers)."""
    import builtins

    real_open, real_os_open = builtins.open, os.open

    def refuse(path) -> None:  # a file in it, or the directory itself (O_TMPFILE)
        if directory.resolve() in (Path(os.fspath(path)).resolve(), Path(path).resolve().parent):
            raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    def guarded_open(path, mode="r", *args, **kwargs):
        if isinstance(path, (str, os.PathLike)) and any(c in mode for c in "wxa"):
            refuse(path)
        return real_open(path, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(os, "open", guarded_os_open)


def test_preprocess_refuses_a_read_only_output_directory_before_reading(files, capfd, monkeypatch):
    d, model = files
    (d / "ro").mkdir(exist_ok=True)
    _read_only(monkeypatch, d / "ro")
    argv = [
        "--input",
        d / "ok.jsonl",
        "--tokenizer-model",
        model,
        "--output-prefix",
        d / "ro" / "x",
        "--no-progress",
    ]
    code, _, err = run_main(PREPROCESS.main, argv, capfd)
    assert_one_line(code, err, 2, f"--output-prefix {d}/ro/x: cannot write in {d}/ro")
    assert "choose a writable directory" in err and os.listdir(d / "ro") == []


def test_preprocess_disk_full_is_exit_3_and_publishes_nothing(files, capfd, monkeypatch):
    d, model = files

    def full(self, tokens, lengths):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(IndexedDatasetWriter, "add_documents", full)
    argv = [
        "--input",
        d / "ok.jsonl",
        "--tokenizer-model",
        model,
        "--output-prefix",
        d / "full" / "x",
        "--no-progress",
    ]
    code, _, err = run_main(PREPROCESS.main, argv, capfd)
    assert_one_line(code, err, 3, "failed (No space left on device); nothing half-written")
    assert os.listdir(d / "full") == []  # no x.bin, no x.bin.<tag>.tmp


def _limit_file_size(limit: int):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def test_preprocess_under_a_file_size_limit_exits_3_and_leaves_nothing(files, tmp_path):
    """The real process: the .bin fits the limit, the .idx does not (the writer's last step)."""
    d, model = files
    (tmp_path / "lines.txt").write_text("a\n" * 2000)  # 2000 one-token documents
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "preprocess_data.py"),
            "--input",
            str(tmp_path / "lines.txt"),
            "--txt-sample-by",
            "line",
            "--tokenizer-model",
            model,
            "--output-prefix",
            str(out / "x"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_file_size(16 << 10),
        env={**os.environ, "HF_DATASETS_OFFLINE": "1"},
    )
    assert_one_line(proc.returncode, proc.stderr, 3, "(File too large); nothing half-written")
    assert os.listdir(out) == []


# -- tools/train_tokenizer.py --------------------------------------------------------------------

# (input file, extra arguments, model prefix (relative), exit code, fragment of the line)
TOKENIZER_CASES = [
    ("none.txt", [], "t/x", 2, "--input file {d}/none.txt does not exist"),
    ("adir.jsonl", [], "t/x", 2, "adir.jsonl is a directory"),
    ("table.parquet", [], "t/x", 2, "table.parquet is not text"),
    ("empty.txt", [], "t/x", 3, "empty.txt is empty (0 bytes): no text to train on"),
    ("number.jsonl", [], "t/x", 3, "number.jsonl:1: 'text' is int, not a string"),
    ("null.jsonl", [], "t/x", 3, "null.jsonl:1: 'text' is null, not a string"),
    ("missing.jsonl", [], "t/x", 3, "missing.jsonl:2: expected a JSON object with a string field"),
    ("broken.jsonl", [], "t/x", 3, "broken.jsonl:2: expected a JSON object"),
    ("blank.jsonl", [], "t/x", 3, "blank.jsonl holds no JSON records"),
    ("binary.jsonl", [], "t/x", 3, "binary.jsonl is not UTF-8 text"),
    ("ok.txt", ["--vocab-size", "10"], "t/x", 2, "--vocab-size 10 is too small"),
    ("ok.txt", ["--vocab-size", "100000"], "t/x", 2, "--vocab-size 100000 is more pieces than"),
    ("ok.txt", ["--num-threads", "0"], "t/x", 2, "--num-threads 0 must be >= 1"),
    ("ok.txt", ["--input-sentence-size", "-1"], "t/x", 2, "--input-sentence-size -1 must be"),
    ("ok.txt", [], "t/", 2, "--model-prefix {d}/t/ has no file name part"),
    ("ok.txt", [], "afile/x", 2, "--model-prefix {d}/afile/x: {d}/afile is a file"),
]


@pytest.mark.parametrize(
    "name, extra, prefix, code, fragment",
    TOKENIZER_CASES,
    ids=[f"{c[0]} {' '.join(c[1])} {c[2]}" for c in TOKENIZER_CASES],
)
def test_train_tokenizer_refuses(files, capfd, name, extra, prefix, code, fragment):
    d, _ = files
    argv = [
        "--input",
        d / name,
        "--model-prefix",
        f"{d}/{prefix}",
        "--vocab-size",
        "300",
        "--num-threads",
        "1",
        *extra,
    ]
    got, _, err = run_main(TOKENIZER.main, argv, capfd)
    assert_one_line(got, err, code, fragment.format(d=d))
    assert not (d / "t").exists() or not os.listdir(d / "t")


def test_train_tokenizer_under_a_file_size_limit_publishes_nothing(files, tmp_path):
    """sentencepiece does not report a write cut short: the tool loads the model back before
    renaming it into place."""
    d, _ = files
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "train_tokenizer.py"),
            "--input",
            str(d / "ok.txt"),
            "--model-prefix",
            str(tmp_path / "tok"),
            "--vocab-size",
            "300",
            "--num-threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_file_size(2048),
    )
    assert_one_line(proc.returncode, proc.stderr, 3, "(the files written were cut short)")
    assert os.listdir(tmp_path) == []


# -- the blend index cache -----------------------------------------------------------------------

WEIGHTS = [0.5, 0.3, 0.2]


def _cache_files(cache: Path) -> dict[str, Path]:
    return {p.name.rsplit("-", 1)[1]: p for p in cache.iterdir()}


def _rebuilt_after(damage, tmp_path, monkeypatch) -> list[str]:
    """Build the cache, ``damage(files)``, read it again; returns what was logged, after checking
    the index read is the true one and was rebuilt."""
    truth = blend_indices(WEIGHTS, 500)
    cached_blend_indices(WEIGHTS, 500, str(tmp_path), lambda m: None)
    damage(_cache_files(tmp_path))
    built = []
    real = blend_module.blend_indices
    monkeypatch.setattr(blend_module, "blend_indices", lambda *a: built.append(1) or real(*a))
    logged = []
    got = cached_blend_indices(WEIGHTS, 500, str(tmp_path), logged.append)
    assert all(np.array_equal(a, b) for a, b in zip(got, truth)) and built == [1]
    again = cached_blend_indices(WEIGHTS, 500, str(tmp_path), lambda m: None)  # now good again
    assert all(np.array_equal(a, b) for a, b in zip(again, truth)) and built == [1]
    return logged


def test_blend_cache_with_a_flipped_byte_is_rebuilt_with_one_line(tmp_path, monkeypatch):
    def flip(files):
        raw = bytearray(files["sample.npy"].read_bytes())
        raw[-3] ^= 0x40  # a high byte of the last sample index: an IndexError later, unchecked
        files["sample.npy"].write_bytes(bytes(raw))

    logged = _rebuilt_after(flip, tmp_path, monkeypatch)
    assert len(logged) == 2 and "built the blend index" in logged[1]
    assert logged[0].startswith(f"[data] blend index cache {tmp_path}/blend-")
    assert "-sample.npy does not match its CRC32" in logged[0] and "rebuilding it" in logged[0]


def test_blend_cache_with_an_edited_in_range_entry_is_rebuilt(tmp_path, monkeypatch):
    def edit(files):
        datasets = np.load(files["dataset.npy"])
        datasets[7] = (datasets[7] + 1) % len(WEIGHTS)  # still a valid dataset index
        np.save(files["dataset.npy"], datasets)

    logged = _rebuilt_after(edit, tmp_path, monkeypatch)
    assert (
        "-dataset.npy does not match its CRC32" in logged[0] and "(damaged or edited)" in logged[0]
    )


def test_blend_cache_without_its_checksums_is_rebuilt(tmp_path, monkeypatch):
    """An interrupted build (or a cache from before the checksums) is built again."""
    logged = _rebuilt_after(lambda files: files["crc32.json"].unlink(), tmp_path, monkeypatch)
    assert len(logged) == 1 and "built the blend index" in logged[0]


def test_preprocess_module_refuses_what_the_tool_does(files):
    """The library functions the tool calls raise InputError for data, ValueError otherwise."""
    d, _ = files
    with pytest.raises(preprocess.InputError, match="row 2 has no 'text' value"):
        list(preprocess.iter_documents(str(d / "missing.jsonl"), "text"))
    with pytest.raises(ValueError, match="no file name part") as e:
        preprocess.check_output_prefix(f"{d}/")
    assert not isinstance(e.value, preprocess.InputError)
