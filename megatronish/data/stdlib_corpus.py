"""Default offline corpus: the running interpreter's standard-library ``.py`` sources.

Every Python install has them, so the default config trains offline on a fresh machine.
The built corpus (tokenizer + .bin/.idx) is cached per Python version, vocab size and size.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time

import numpy as np

from megatronish.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from megatronish.data.sentencepiece_tokenizer import SentencePieceTokenizer, train_sentencepiece
from megatronish.distributed.cpus import usable_cpus
from megatronish.file_modes import follow_umask

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})
MARKER = "COMPLETE.json"
DATA_NAME = "data"  # indexed prefix inside the cache dir
TOKENIZER_NAME = "tokenizer"


def _log(msg: str) -> None:
    print(f"[data] {msg}", flush=True)


def stdlib_source_files(stdlib_dir: str | None = None) -> list[str]:
    """Sorted ``.py`` files of the standard library, without tests, idlelib, lib2to3, packages."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and d != "__pycache__"]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: os.path.relpath(p, root))


def collect_stdlib_texts(max_corpus_mb: float) -> list[str]:
    """Decoded stdlib sources in sorted order, each taken if it still fits the budget.

    The budget is ``max_corpus_mb * 10**6`` bytes of UTF-8; files that would overflow it,
    undecodable and empty files are skipped.
    """
    budget = int(max_corpus_mb * 1e6)
    texts, total = [], 0
    for path in stdlib_source_files():
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        size = len(text.encode("utf-8"))
        if size == 0 or total + size > budget:
            continue
        texts.append(text)
        total += size
    return texts


def stdlib_cache_name(vocab_size: int, max_corpus_mb: float) -> str:
    """The cache folder of the corpus and tokenizer for this Python, vocabulary and size."""
    v = sys.version_info
    return f"stdlib-py{v.major}{v.minor}-v{vocab_size}-{max_corpus_mb:g}mb"


def _paths(directory: str) -> tuple[str, str]:
    return os.path.join(directory, DATA_NAME), os.path.join(directory, TOKENIZER_NAME + ".model")


def _build(out_dir: str, vocab_size: int, max_corpus_mb: float) -> dict:
    """Build the corpus into ``out_dir``; returns stats (written to the marker last)."""
    t0 = time.perf_counter()
    texts = collect_stdlib_texts(max_corpus_mb)
    if not texts:
        raise RuntimeError(
            f"no standard-library sources found under {sysconfig.get_paths()['stdlib']} within "
            f"max_corpus_mb={max_corpus_mb}; raise data.max_corpus_mb or use data.source=indexed"
        )
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    _log(f"collected {len(texts)} stdlib files ({nbytes / 1e6:.2f} MB)")
    corpus_txt = os.path.join(out_dir, "corpus.txt")
    with open(corpus_txt, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(text if text.endswith("\n") else text + "\n")
    threads = usable_cpus()
    _log(f"training sentencepiece BPE tokenizer (vocab {vocab_size})")
    model = train_sentencepiece(
        [corpus_txt], os.path.join(out_dir, TOKENIZER_NAME), vocab_size, num_threads=threads
    )
    os.unlink(corpus_txt)
    tokenizer = SentencePieceTokenizer(model)
    _log(f"tokenizing {len(texts)} documents")
    ids = tokenizer.encode_batch(texts, num_threads=threads)
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    eod = np.array([tokenizer.eod_id], dtype=np.int32)
    flat = np.concatenate([a for doc in ids for a in (np.array(doc, dtype=np.int32), eod)])
    with IndexedDatasetWriter(_paths(out_dir)[0], dtype_for_vocab(tokenizer.vocab_size)) as w:
        w.add_documents(flat, lengths)
    stats = {
        "documents": len(texts),
        "bytes": nbytes,
        "tokens": int(lengths.sum()),
        "vocab_size": tokenizer.vocab_size,
        "python": sys.version.split()[0],
        "build_seconds": round(time.perf_counter() - t0, 2),
    }
    _log(f"wrote {stats['tokens']} tokens in {stats['build_seconds']:.1f}s")
    return stats


def ensure_stdlib_corpus(cache_dir: str, vocab_size: int, max_corpus_mb: float) -> tuple[str, str]:
    """Build (once) or reuse the stdlib corpus; returns (indexed prefix, tokenizer .model path).

    The cache lives in ``cache_dir/stdlib-py{XY}-v{vocab}-{mb}mb/``. It is built in a temporary
    sibling directory and renamed into place after its marker file is written, so concurrent
    callers either see a complete cache or build their own copy and keep the first one.
    """
    cache_dir = os.path.expanduser(cache_dir)
    final = os.path.join(cache_dir, stdlib_cache_name(vocab_size, max_corpus_mb))
    if os.path.isfile(os.path.join(final, MARKER)):
        return _paths(final)
    if os.path.exists(final):
        raise RuntimeError(f"{final} exists but is incomplete (no {MARKER}); delete it to rebuild")
    os.makedirs(cache_dir, exist_ok=True)
    _log(f"building the default corpus in {final} (one time)")
    tmp = tempfile.mkdtemp(prefix=os.path.basename(final) + ".tmp-", dir=cache_dir)
    follow_umask(tmp)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        stats = _build(tmp, vocab_size, max_corpus_mb)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(stats, f, indent=1)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, MARKER)):
                raise
            _log("another process finished the same corpus first; using it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _paths(final)
