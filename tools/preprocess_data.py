"""Tokenize .jsonl / .json / .parquet / .arrow / .txt files into Megatron-compatible .bin/.idx.

Inputs are streamed (nothing is cached, memory stays bounded whatever their size), tokenized by
--workers processes with --tokenizer-model (a sentencepiece .model, a Hugging Face tokenizer.json
or a directory holding one, e.g. an HF model directory) and written in input order: the output
is the same bytes for any worker count. One record is one document: a JSON line, a parquet or
arrow row (text under --json-key), or a .txt file, paragraph or line (--txt-sample-by),
followed by the end-of-document id (the tokenizer's eos) unless --no-append-eod.

Examples:
    python tools/preprocess_data.py --input 'data/web/*.jsonl' --tokenizer-model tok/spm.model \\
        --output-prefix data/web_text_document --workers 8
    python tools/preprocess_data.py --input 'shards/*.parquet' --tokenizer-model tok/spm.model \\
        --output-prefix data/books --output-per-input   # data/books_<shard>.bin/.idx each
    python tools/preprocess_data.py --input web.jsonl --tokenizer-model hf/gpt2 \\
        --output-prefix data/web_gpt2   # an HF model directory's tokenizer.json

Exit codes: 0 written, 2 a bad argument (an input that matches no file, an unsupported
extension, a tokenizer that does not exist or a directory without a tokenizer.json, an
--output-prefix without a file name or in a directory that cannot be written), 3 bad data (an
empty or unreadable input, a record without a string under --json-key, named by file and row; a
tokenizer file that is not a tokenizer, an HF tokenizer that names no eos token) or a write that
failed (disk full, file size limit). Each error is one line on stderr; nothing half-written is
published under the output names.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from megatronish.config.cli_errors import OneLineArgumentParser
from megatronish.data import preprocess
from megatronish.data.indexed import dtype_for_vocab
from megatronish.data.tokenizer import Tokenizer, load_tokenizer

EXIT_ARGS = 2
EXIT_DATA = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="files or quoted globs")
    p.add_argument("--json-key", default="text", help="text column of jsonl/parquet/arrow (text)")
    p.add_argument(
        "--txt-sample-by",
        choices=["document", "paragraph", "line"],
        default="document",
        help="what one .txt document is: the whole file, a blank-line separated paragraph, "
        "or a line (document)",
    )
    p.add_argument(
        "--tokenizer-model",
        required=True,
        help="sentencepiece .model file, Hugging Face tokenizer.json or a directory holding one",
    )
    p.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx (atomically)"
    )
    p.add_argument(
        "--output-per-input",
        action="store_true",
        help="one PREFIX_<input file stem>.bin/.idx per input instead of one for all",
    )
    p.add_argument(
        "--workers",
        "--num-proc",
        type=int,
        default=1,
        dest="workers",
        help="tokenizer processes (1); the output does not depend on it",
    )
    p.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the end-of-document id to every document (on)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers {args.workers} must be >= 1")
    return args


def _refuse(code: int, message: str) -> int:
    print(f"{'invalid argument' if code == EXIT_ARGS else 'error'}: {message}", file=sys.stderr)
    return code


def _checked(args: argparse.Namespace) -> tuple[list[str], Tokenizer] | int:
    """``(input files, tokenizer)``, or the exit code after saying what is wrong (inputs,
    tokenizer, then outputs: their directories are created only when the rest is usable)."""
    try:
        files = preprocess.resolve_inputs(args.input)
        prefixes = preprocess.output_prefixes(files, args.output_prefix, args.output_per_input)
    except preprocess.InputError as e:
        return _refuse(EXIT_DATA, str(e))
    except ValueError as e:
        return _refuse(EXIT_ARGS, str(e))
    try:
        tok = load_tokenizer(args.tokenizer_model)
    except FileNotFoundError as e:  # --tokenizer-model names no tokenizer
        return _refuse(EXIT_ARGS, f"--tokenizer-model: {e}")
    except (ValueError, OSError) as e:  # a file that is not a tokenizer
        return _refuse(EXIT_DATA, str(e))
    try:
        for prefix in dict.fromkeys(prefixes):
            preprocess.check_output_prefix(prefix)
    except ValueError as e:
        return _refuse(EXIT_ARGS, str(e))
    return files, tok


def _write_failed(error: OSError, prefix: str) -> str:
    return (
        f"writing --output-prefix {prefix} failed ({error.strerror or error}); nothing "
        "half-written was published: free space (or raise the file size limit) and run it again"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = parse_args(argv)
    checked = _checked(args)
    if isinstance(checked, int):
        return checked
    files, tok = checked
    from tqdm import tqdm

    bar = tqdm(desc="tokenizing", unit=" docs", disable=args.no_progress or None, mininterval=1)
    t0, tokens = time.perf_counter(), 0

    def progress(docs: int, n: int) -> None:
        nonlocal tokens
        tokens += n
        bar.update(docs)
        bar.set_postfix_str(f"{tokens / (time.perf_counter() - t0):,.0f} tokens/s", refresh=False)

    try:
        written = preprocess.preprocess(
            files,
            tok.model_path,
            args.output_prefix,
            key=args.json_key,
            txt_sample_by=args.txt_sample_by,
            append_eod=args.append_eod,
            workers=args.workers,
            per_input=args.output_per_input,
            progress=progress,
        )
    except preprocess.InputError as e:
        return _refuse(EXIT_DATA, str(e))
    except ValueError as e:
        return _refuse(EXIT_ARGS, str(e))
    except OSError as e:  # ENOSPC, EFBIG (RLIMIT_FSIZE), EIO while writing
        return _refuse(EXIT_DATA, _write_failed(e, args.output_prefix))
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    print(preprocess.throughput_line(written, seconds, dtype_for_vocab(tok.vocab_size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
