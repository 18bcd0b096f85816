"""Tokenize .jsonl / .txt / .parquet files into a Megatron-compatible .bin/.idx (MMIDIDX) dataset.

Files are loaded with Hugging Face `datasets` (offline: HF_DATASETS_OFFLINE defaults to 1,
only local files are read). One record is one document: a JSON line or parquet row (text
under --json-key), or a whole .txt file (see --txt-sample-by). Each document is tokenized
with the sentencepiece --tokenizer-model and, by default, followed by the end-of-document id.

Example:
    python tools/preprocess_data.py --input 'data/*.jsonl' --tokenizer-model tok/spm.model \\
        --output-prefix data/corpus --num-proc 8
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402

try:
    from megatronish.data.indexed import IndexedDatasetWriter, dtype_for_vocab
    from megatronish.data.tokenizer import Tokenizer
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megatronish.data.indexed import IndexedDatasetWriter, dtype_for_vocab
    from megatronish.data.tokenizer import Tokenizer

BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--input", nargs="+", required=True, help="files or quoted globs, all of one format"
    )
    p.add_argument("--json-key", default="text", help="text column of jsonl/parquet (text)")
    p.add_argument(
        "--txt-sample-by",
        choices=["document", "paragraph", "line"],
        default="document",
        help="what one .txt document is: the whole file, a blank-line separated paragraph, "
        "or a line (document)",
    )
    p.add_argument("--tokenizer-model", required=True, help="sentencepiece .model file")
    p.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx (atomically)"
    )
    p.add_argument("--num-proc", type=int, default=1, help="tokenizer processes (1)")
    p.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the end-of-document id to every document (on)",
    )
    p.add_argument(
        "--hf-cache-dir",
        default=None,
        help="datasets cache for the loaded and tokenized tables (default: a temporary "
        "directory next to the output, deleted at the end)",
    )
    return p.parse_args(argv)


def resolve_inputs(patterns: list[str]) -> tuple[str, list[str]]:
    """Expand globs; returns (datasets builder name, sorted files)."""
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise SystemExit(f"--input {pattern} matches no file")
        files += matches
    kinds = {os.path.splitext(f)[1].lower() for f in files}
    unknown = kinds - set(BUILDERS)
    if unknown:
        raise SystemExit(
            f"--input: unsupported extension(s) {sorted(unknown)}; use {list(BUILDERS)}"
        )
    builders = {BUILDERS[k] for k in kinds}
    if len(builders) != 1:
        raise SystemExit(f"--input mixes formats {sorted(kinds)}; preprocess them separately")
    return builders.pop(), files


def tokenize_batch(
    batch: dict, *, model_path: str, key: str, append_eod: bool
) -> dict[str, list[list[int]]]:
    """datasets.map function; loads the tokenizer in the worker (it is never pickled)."""
    tok = Tokenizer(model_path)
    ids = tok.encode_batch([t or "" for t in batch[key]])
    if append_eod:
        for doc in ids:
            doc.append(tok.eod_id)
    return {"ids": ids}


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    builder, files = resolve_inputs(args.input)
    tok = Tokenizer(args.tokenizer_model)
    out_dir = os.path.dirname(os.path.abspath(os.path.expanduser(args.output_prefix)))
    os.makedirs(out_dir, exist_ok=True)

    import datasets  # slow import; after argument checks

    with tempfile.TemporaryDirectory(prefix=".hf-cache-", dir=out_dir) as tmp_cache:
        cache = args.hf_cache_dir or tmp_cache
        kwargs = {"sample_by": args.txt_sample_by} if builder == "text" else {}
        ds = datasets.load_dataset(
            builder, data_files=files, split="train", cache_dir=cache, **kwargs
        )
        key = "text" if builder == "text" else args.json_key
        if key not in ds.column_names:
            raise SystemExit(f"{files[0]}: no column {key!r} (has {ds.column_names}); --json-key")
        t0 = time.perf_counter()
        ds = ds.map(
            tokenize_batch,
            batched=True,
            batch_size=256,
            num_proc=args.num_proc if args.num_proc > 1 else None,
            remove_columns=ds.column_names,
            features=datasets.Features({"ids": datasets.Sequence(datasets.Value("int32"))}),
            fn_kwargs={
                "model_path": tok.model_path,
                "key": key,
                "append_eod": args.append_eod,
            },
            desc="tokenizing",
        )
        n_docs, n_tokens = 0, 0
        with IndexedDatasetWriter(args.output_prefix, dtype_for_vocab(tok.vocab_size)) as w:
            for table in ds.with_format("arrow").iter(batch_size=8192):
                col = table.column("ids").combine_chunks()
                lengths = np.diff(col.offsets.to_numpy())
                w.add_documents(col.flatten().to_numpy(), lengths)
                n_docs += len(lengths)
                n_tokens += int(lengths.sum())
        seconds = time.perf_counter() - t0
    print(
        f"wrote {args.output_prefix}.bin/.idx: {n_docs} documents, {n_tokens} tokens "
        f"({np.dtype(dtype_for_vocab(tok.vocab_size))}) in {seconds:.1f}s, "
        f"{n_tokens / max(seconds, 1e-9):,.0f} tokens/s",
        flush=True,
    )


if __name__ == "__main__":
    main()
