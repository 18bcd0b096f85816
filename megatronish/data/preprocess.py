"""Tokenize text files of any size into Megatron-compatible .bin/.idx datasets.

Inputs (.jsonl / .json, .parquet, .arrow, .txt, mixed) are streamed with Hugging Face
``datasets`` (``streaming=True``: nothing is cached, memory stays bounded), cut into chunks of
documents, tokenized by ``workers`` processes and written in input order, so the output is the
same bytes whatever the worker count. One record is one document: a JSON line, a parquet or
arrow row (text under ``key``), or a .txt file, paragraph or line (``txt_sample_by``).

Bad arguments raise ValueError; input that is not documents (an empty or unreadable file, a
record without a string under ``key``) raises :class:`InputError`, naming the file and row.
"""

from __future__ import annotations

import collections
import functools
import glob
import multiprocessing
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.pool import Pool

import numpy as np

from megatronish.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from megatronish.data.tokenizer import Tokenizer, load_tokenizer

BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".txt": "text",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
CHUNK_DOCS = 512  # documents per task: big enough to amortise the hand-off, small for order


class InputError(ValueError):
    """An input file that cannot be read, or a record in it that is not a document."""


def resolve_inputs(patterns: list[str]) -> list[str]:
    """Expand files and globs (each must match) into a sorted, de-duplicated file list.
    Raises :class:`InputError` for an empty file (there is nothing to tokenize in it)."""
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise ValueError(f"--input {pattern} matches no file")
        for m in matches:
            if os.path.isdir(m):
                raise ValueError(f"--input {m} is a directory; give its files, e.g. '{m}/*.jsonl'")
        files += [m for m in matches if m not in files]
    unknown = sorted({os.path.splitext(f)[1].lower() for f in files} - set(BUILDERS))
    if unknown:
        raise ValueError(f"--input: unsupported extension(s) {unknown}; use {list(BUILDERS)}")
    for f in files:
        if os.path.getsize(f) == 0:
            raise InputError(f"{f} is empty (0 bytes): nothing to tokenize; remove it from --input")
    return files


def check_output_prefix(prefix: str, flag: str = "--output-prefix", ext: str = ".bin") -> None:
    """Refuse an output prefix (given as ``flag``) that has no file name part or whose directory
    cannot be created or written: found before any work, not after hours of it."""
    if os.path.basename(prefix) in ("", ".", ".."):
        raise ValueError(
            f"{flag} {prefix} has no file name part: it would write {prefix}{ext} as a hidden "
            f"file; give a name, e.g. {os.path.join(prefix, 'corpus')}"
        )
    directory = os.path.dirname(os.path.abspath(os.path.expanduser(prefix)))
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {prefix}: {existing} is a file, not a directory; choose another")
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except OSError as e:
        raise ValueError(
            f"{flag} {prefix}: cannot write in {directory} ({e.strerror or e}); choose a "
            "writable directory"
        ) from None


def output_prefixes(files: list[str], prefix: str, per_input: bool) -> list[str]:
    """The output prefix of each input: all the same, or ``PREFIX_<file stem>`` per input."""
    if not per_input:
        return [prefix] * len(files)
    stems = [os.path.splitext(os.path.basename(f))[0] for f in files]
    clash = sorted({s for s in stems if stems.count(s) > 1})
    if clash:
        raise ValueError(f"--output-per-input: several inputs are named {clash}; rename them")
    return [f"{prefix}_{s}" for s in stems]


def _first_line(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return lines[0] if lines else type(error).__name__


def _rows(path: str, builder: str, kwargs: dict) -> Iterator[dict]:
    """The records of one file, streamed; a file the reader cannot parse is an InputError."""
    import datasets  # slow import, only where needed

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors are ours to report
    try:
        ds = datasets.load_dataset(
            builder, data_files=[path], split="train", streaming=True, **kwargs
        )
        yield from ds
    except Exception as e:  # noqa: BLE001 - pyarrow, json, codecs and datasets raise many types
        raise InputError(
            f"cannot read {path} as {builder} ({_first_line(e)}); fix or remove it"
        ) from None


def _not_text(value, column: str) -> str:
    if value is None:
        return f"has no {column!r} value (missing or null)"
    shown = repr(value) if len(repr(value)) <= 30 else repr(value)[:30] + "..."
    return f"has {column!r} = {shown} ({type(value).__name__}), not a string"


def iter_documents(path: str, key: str, txt_sample_by: str = "document") -> Iterator[str]:
    """The documents of one file, streamed. Raises :class:`InputError` naming the file (and
    row) when it cannot be read, holds no record, or a record has no string under ``key``."""
    builder = BUILDERS[os.path.splitext(path)[1].lower()]
    kwargs = {"sample_by": txt_sample_by} if builder == "text" else {}
    column = "text" if builder == "text" else key
    rows = 0
    for rows, row in enumerate(_rows(path, builder, kwargs), 1):
        if rows == 1 and column not in row:
            raise InputError(f"{path}: no column {column!r} (has {sorted(row)}); use --json-key")
        text = row[column]
        if not isinstance(text, str):
            raise InputError(
                f"{path}: row {rows} {_not_text(text, column)}; fix the row (or remove it), "
                "or choose the text column with --json-key"
            )
        yield text
    if rows == 0:
        raise InputError(f"{path} holds no records: nothing to tokenize; remove it from --input")


@functools.lru_cache(maxsize=2)
def _tokenizer(model_path: str) -> Tokenizer:
    return load_tokenizer(model_path)  # once per worker process


def tokenize_chunk(texts: list[str], model_path: str, append_eod: bool) -> tuple[bytes, bytes]:
    """Token ids and document lengths of ``texts`` (int32 and int64 bytes: cheap to hand back)."""
    tok = _tokenizer(model_path)
    docs = tok.encode_batch(texts)
    if append_eod:
        for d in docs:
            d.append(tok.eod_id)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    flat = np.fromiter((t for d in docs for t in d), dtype=np.int32, count=int(lengths.sum()))
    return flat.tobytes(), lengths.tobytes()


def _chunks(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def ordered_map(fn: Callable, items: Iterable, pool: Pool | None, window: int) -> Iterator:
    """``fn(item)`` for each item in order, at most ``window`` in flight on ``pool`` (in this
    process when ``pool`` is None), so a huge input never sits in memory."""
    if pool is None:
        yield from map(fn, items)
        return
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


@dataclass
class Written:
    prefix: str
    documents: int = 0
    tokens: int = 0


def preprocess(
    files: list[str],
    model_path: str,
    output_prefix: str,
    *,
    key: str = "text",
    txt_sample_by: str = "document",
    append_eod: bool = True,
    workers: int = 1,
    per_input: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> list[Written]:
    """Tokenize ``files`` into one .bin/.idx (or one per input); returns what each holds.
    ``progress(documents, tokens)`` is called after every chunk."""
    tok = load_tokenizer(model_path)
    dtype = dtype_for_vocab(tok.vocab_size)
    prefixes = output_prefixes(files, output_prefix, per_input)
    work = functools.partial(tokenize_chunk, model_path=tok.model_path, append_eod=append_eod)
    # Workers start before any reader thread exists (fork is then safe and fast).
    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    pool = context.Pool(workers) if workers > 1 else None
    out: list[Written] = []
    try:
        for prefix in dict.fromkeys(prefixes):  # each output once, its inputs in order
            check_output_prefix(prefix)
            written = Written(prefix)
            with IndexedDatasetWriter(prefix, dtype) as writer:
                for path in (f for f, p in zip(files, prefixes) if p == prefix):
                    docs = iter_documents(path, key, txt_sample_by)
                    for flat, lengths in ordered_map(
                        work, _chunks(docs, CHUNK_DOCS), pool, 4 * workers
                    ):
                        ids = np.frombuffer(flat, dtype=np.int32)
                        lens = np.frombuffer(lengths, dtype=np.int64)
                        writer.add_documents(ids, lens)
                        written.documents += len(lens)
                        written.tokens += int(lens.sum())
                        if progress is not None:
                            progress(len(lens), int(lens.sum()))
            out.append(written)
    finally:
        if pool is not None:
            pool.terminate()
    return out


def throughput_line(written: list[Written], seconds: float, dtype: type[np.number]) -> str:
    """The closing summary line."""
    docs, tokens = sum(w.documents for w in written), sum(w.tokens for w in written)
    where = ", ".join(f"{w.prefix}.bin/.idx" for w in written)
    return (
        f"wrote {where}: {docs} documents, {tokens} tokens ({np.dtype(dtype)}) in "
        f"{seconds:.1f}s, {tokens / max(seconds, 1e-9):,.0f} tokens/s"
    )
