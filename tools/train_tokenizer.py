"""Train a sentencepiece BPE tokenizer (byte fallback) on .txt / .jsonl files.

A Hugging Face tokenizer needs no training here: give its tokenizer.json, or the model directory
holding it, to tools/preprocess_data.py --tokenizer-model and data.tokenizer_model directly.

Example:
    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix tok/spm --vocab-size 8192

Exit codes: 0 written, 2 a bad argument (an input that does not exist or is not text, a vocab
size, thread count or sentence count out of range, a --model-prefix without a file name or in a
directory that cannot be written), 3 bad data (an empty input, a JSON line without a string
under --json-key, named by file and line, text sentencepiece cannot train on) or a write that
failed. Each error is one line on stderr; PREFIX.model and PREFIX.vocab appear only complete.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

from megatronish.config.cli_errors import OneLineArgumentParser
from megatronish.data.preprocess import check_output_prefix
from megatronish.data.sentencepiece_tokenizer import SentencePieceTokenizer, train_sentencepiece
from megatronish.distributed.cpus import usable_cpus

EXIT_ARGS = 2
EXIT_DATA = 3
JSON_LINES = (".jsonl", ".json")
# Not text: tokenize them with tools/preprocess_data.py, or export their text first.
NOT_TEXT = (
    ".parquet",
    ".arrow",
    ".gz",
    ".bz2",
    ".xz",
    ".zst",
    ".zip",
    ".bin",
    ".idx",
    ".npy",
    ".model",
)
MIN_VOCAB = 260  # byte fallback alone takes 259 ids
TOO_HIGH = re.compile(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)")


class InputError(ValueError):
    """An input file that holds no text to train on, or a JSON line that is not a record."""


class WriteError(Exception):
    """The tokenizer files could not be written whole."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
        "--num-threads", type=int, default=usable_cpus(), help="trainer threads (all usable CPUs)"
    )
    args = p.parse_args(argv)
    if args.vocab_size < MIN_VOCAB:
        p.error(
            f"--vocab-size {args.vocab_size} is too small: byte fallback alone takes 259 ids; "
            f"use at least {MIN_VOCAB}"
        )
    for flag, value in (
        ("--input-sentence-size", args.input_sentence_size),
        ("--num-threads", args.num_threads),
    ):
        if value < 1:
            p.error(f"{flag} {value} must be >= 1")
    return args


def check_inputs(paths: list[str]) -> None:
    """Refuse inputs that are missing or not text (ValueError) or empty (InputError)."""
    for path in paths:
        if not os.path.isfile(path):
            what = "is a directory" if os.path.isdir(path) else "does not exist"
            raise ValueError(f"--input file {path} {what}; give .txt or .jsonl files")
        if path.lower().endswith(NOT_TEXT):
            raise ValueError(
                f"--input {path} is not text: give .txt or .jsonl files (export the text of "
                "parquet/arrow/compressed files first)"
            )
        if os.path.getsize(path) == 0:
            raise InputError(f"{path} is empty (0 bytes): no text to train on; remove it")


def jsonl_to_text(path: str, key: str, out_path: str) -> int:
    """Write the ``key`` field of every record of ``path`` to ``out_path``; returns the count.
    Raises :class:`InputError` naming the line that is not a record with a string ``key``."""
    count = 0
    with open(path, encoding="utf-8") as src, open(out_path, "w", encoding="utf-8") as dst:
        try:
            for lineno, line in enumerate(src, 1):
                if not line.strip():
                    continue
                text = _text_of(line, key, f"{path}:{lineno}")
                dst.write(text if text.endswith("\n") else text + "\n")
                count += 1
        except UnicodeDecodeError as e:
            raise InputError(f"{path} is not UTF-8 text ({e.reason}); fix or remove it") from None
    if count == 0:
        raise InputError(f"{path} holds no JSON records: no text to train on; remove it")
    return count


def _text_of(line: str, key: str, where: str) -> str:
    try:
        text = json.loads(line)[key]
    except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
        raise InputError(
            f"{where}: expected a JSON object with a string field {key!r} "
            f"({type(e).__name__}: {e}); fix the file or pass --json-key"
        ) from None
    if not isinstance(text, str):
        raise InputError(
            f"{where}: {key!r} is {type(text).__name__ if text is not None else 'null'}, not a "
            "string; fix the line or pass --json-key"
        )
    return text


def train(args: argparse.Namespace, tmp: str) -> str:
    """Train into a temporary prefix beside ``--model-prefix`` and rename the files into place
    (a killed or failed run leaves no half-written model); returns the ``.model`` path."""
    text_files = []
    for i, path in enumerate(args.input):
        if path.lower().endswith(JSON_LINES):
            out = os.path.join(tmp, f"{i}.txt")
            n = jsonl_to_text(path, args.json_key, out)
            print(f"{path}: {n} records", flush=True)
            text_files.append(out)
        else:
            text_files.append(path)
    prefix = os.path.expanduser(args.model_prefix)
    staging = f"{prefix}.{os.getpid()}.tmp"
    try:
        train_sentencepiece(
            text_files,
            staging,
            args.vocab_size,
            input_sentence_size=args.input_sentence_size,
            num_threads=args.num_threads,
        )
        check_written(staging)
        os.replace(staging + ".vocab", prefix + ".vocab")
        os.replace(staging + ".model", prefix + ".model")
    finally:
        for ext in (".model", ".vocab"):
            if os.path.exists(staging + ext):
                os.remove(staging + ext)
    return prefix + ".model"


def check_written(prefix: str) -> None:
    """Raise :class:`WriteError` unless ``prefix.model`` loads and ``prefix.vocab`` lists every
    piece (sentencepiece does not report a write cut short by a full disk or a size limit)."""
    try:
        pieces = SentencePieceTokenizer(prefix + ".model").vocab_size
        with open(prefix + ".vocab", encoding="utf-8") as f:
            whole = sum(1 for _ in f) == pieces
    except (ValueError, OSError):
        whole = False
    if not whole:
        raise WriteError("the files written were cut short")


def _refuse(code: int, message: str) -> int:
    print(f"{'invalid argument' if code == EXIT_ARGS else 'error'}: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = parse_args(argv)
    try:
        check_inputs(args.input)
        check_output_prefix(args.model_prefix, "--model-prefix", ".model")
    except InputError as e:
        return _refuse(EXIT_DATA, str(e))
    except ValueError as e:
        return _refuse(EXIT_ARGS, str(e))
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="train_tokenizer-") as tmp:
            model = train(args, tmp)
    except InputError as e:
        return _refuse(EXIT_DATA, str(e))
    except ValueError as e:  # sentencepiece could not train on this text
        if m := TOO_HIGH.search(str(e)):
            return _refuse(
                EXIT_ARGS,
                f"--vocab-size {args.vocab_size} is more pieces than this text has (at most "
                f"{m.group(1)}); use a smaller one or more text",
            )
        return _refuse(EXIT_DATA, " ".join(str(e).split()))
    except (OSError, WriteError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return _refuse(
            EXIT_DATA,
            f"writing {args.model_prefix}.model failed ({why}); nothing "
            "half-written was published: free space (or raise the file size limit) "
            "and run it again",
        )
    tok = SentencePieceTokenizer(model)
    print(
        f"wrote {model} (vocab {tok.vocab_size}, eod id {tok.eod_id}) "
        f"in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
