"""Preprocessing throughput: tools/preprocess_data.py (stream, tokenize, write .bin/.idx) vs
sentencepiece's own encode of the same texts already in memory, at 1 and 2 workers / threads.
Run alone: ``.venv/bin/python tools/bench/data.py``.
"""

from __future__ import annotations

import json
import sysconfig
import tempfile
import time
from pathlib import Path

from common import cli, median, table

from megatronish.data import preprocess
from megatronish.data.sentencepiece_tokenizer import SentencePieceTokenizer
from megatronish.data.stdlib_corpus import ensure_stdlib_corpus

CACHE = "~/.cache/megatronish"  # the default run's tokenizer (built once if missing)


def corpus(path: Path, limit_mb: float) -> list[str]:
    """The standard library's modules as a jsonl corpus (one document per file)."""
    texts, size = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = f.read_text(errors="replace")
        texts.append(text)
        size += len(text.encode())
        if size > limit_mb * 2**20:
            break
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def run(quick: bool) -> dict:
    _, model = ensure_stdlib_corpus(CACHE, 4096, 8.0)
    tok = SentencePieceTokenizer(model)
    with tempfile.TemporaryDirectory() as tmp:
        texts = corpus(Path(tmp) / "corpus.jsonl", 8 if quick else 32)
        tokens = sum(len(d) + 1 for d in tok.encode_batch(texts))  # with the eod ids
        variants = {
            **{
                f"sentencepiece encode, {n} thread(s)": (
                    lambda n=n: tok.encode_batch(texts, num_threads=n)
                )
                for n in (1, 2)
            },
            **{
                f"preprocess_data, {n} worker(s)": (
                    lambda n=n: preprocess.preprocess(
                        [str(Path(tmp) / "corpus.jsonl")],
                        model,
                        str(Path(tmp) / f"out{n}"),
                        workers=n,
                    )
                )
                for n in (1, 2)
            },
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(2 if quick else 5):
            for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
                t0 = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - t0)
        size_mb = (Path(tmp) / "corpus.jsonl").stat().st_size / 2**20
    rate = {n: tokens / median(t) for n, t in times.items()}
    rows = []
    for n in (1, 2):
        ours = rate[f"preprocess_data, {n} worker(s)"]
        sp = rate[f"sentencepiece encode, {n} thread(s)"]
        rows.append([n, ours, sp, ours / sp])
    return {
        "title": "Preprocessing throughput vs sentencepiece's encode",
        "config": {
            "documents": len(texts),
            "tokens": tokens,
            "jsonl_mb": size_mb,
            "tokenizer": model,
        },
        "results": {"times": times, "tokens_per_s": rate},
        "tables": [
            table(
                f"Tokens/s on {len(texts)} documents, {tokens:,} tokens "
                f"({size_mb:.1f} MB of jsonl), median of repeats",
                [
                    "workers / threads|",
                    "preprocess_data tokens/s|,.0f",
                    "sentencepiece encode tokens/s|,.0f",
                    "preprocess / encode|.2f",
                ],
                rows,
            )
        ],
        "facts": {
            "preprocess_data, 2 workers / 1 worker|.2fx": rate["preprocess_data, 2 worker(s)"]
            / rate["preprocess_data, 1 worker(s)"]
        },
    }


if __name__ == "__main__":
    cli(run, __doc__)
