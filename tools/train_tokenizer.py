"""Train a sentencepiece BPE tokenizer (byte fallback) on .txt / .jsonl files.

Example:
    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix tok/spm --vocab-size 8192
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

try:
    from megatronish.data.tokenizer import Tokenizer, train_sentencepiece
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megatronish.data.tokenizer import Tokenizer, train_sentencepiece


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="text files: .txt (used as is, one sentence per line) or .jsonl (one JSON object "
        "per line, text under --json-key)",
    )
    p.add_argument("--json-key", default="text", help="text field of .jsonl records (text)")
    p.add_argument(
        "--model-prefix", required=True, help="output path prefix: writes PREFIX.model/.vocab"
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (4096)")
    p.add_argument(
        "--input-sentence-size",
        type=int,
        default=2_000_000,
        help="train on at most this many randomly sampled lines (2000000)",
    )
    p.add_argument(
        "--num-threads", type=int, default=os.cpu_count() or 1, help="trainer threads (all CPUs)"
    )
    return p.parse_args(argv)


def jsonl_to_text(path: str, key: str, out_path: str) -> int:
    """Write the ``key`` field of every record of ``path`` to ``out_path``; returns the count."""
    count = 0
    with open(path, encoding="utf-8") as src, open(out_path, "w", encoding="utf-8") as dst:
        for lineno, line in enumerate(src, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[key]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SystemExit(
                    f"{path}:{lineno}: expected a JSON object with a string field {key!r} "
                    f"({type(e).__name__}: {e}); fix the file or pass --json-key"
                ) from e
            dst.write(text if text.endswith("\n") else text + "\n")
            count += 1
    return count


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    for path in args.input:
        if not os.path.isfile(path):
            raise SystemExit(f"--input file {path} does not exist")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="train_tokenizer-") as tmp:
        text_files = []
        for i, path in enumerate(args.input):
            if path.endswith(".jsonl"):
                out = os.path.join(tmp, f"{i}.txt")
                n = jsonl_to_text(path, args.json_key, out)
                print(f"{path}: {n} records", flush=True)
                text_files.append(out)
            else:
                text_files.append(path)
        try:
            model = train_sentencepiece(
                text_files,
                args.model_prefix,
                args.vocab_size,
                input_sentence_size=args.input_sentence_size,
                num_threads=args.num_threads,
            )
        except ValueError as e:
            raise SystemExit(str(e)) from e
    tok = Tokenizer(model)
    print(
        f"wrote {model} (vocab {tok.vocab_size}, eod id {tok.eod_id}) "
        f"in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )


if __name__ == "__main__":
    main()
