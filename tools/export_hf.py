"""Export a megatronish checkpoint as a Hugging Face model directory (config.json + safetensors
+ the tokenizer).

CKPT is a checkpoint.dir (its ``latest`` step) or one step_XXXXXXX directory, saved with any
layout (tensors are stored globally). llama exports as LlamaForCausalLM, gpt2 as GPT2LMHeadModel,
a llama mixture of experts (every block, no shared experts) as MixtralForCausalLM, a llama
with per-head query/key norms (model.qk_norm) as Qwen3ForCausalLM or Qwen3MoeForCausalLM;
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads the result. The weights are exported
(no optimizer state) with the run's tokenizer, so ``AutoTokenizer.from_pretrained(OUT_DIR)``
gives the ids the run trained on: the checkpoint's data.tokenizer_model, the built-in corpus's
cached sentencepiece model, or (for a checkpoint of tools/import_hf.py) the HF directory's
tokenizer; --tokenizer PATH names another. A sentencepiece model is written as tokenizer.model
and a tokenizer.json converted from it (checked to give the same ids), an HF tokenizer.json is
copied with its companion files. One line says what was written; when the run's tokenizer is
gone or does not fit the model a warning says so and the weights are still exported.

The vocabulary padding is cut to the real vocabulary size, found in this order: --vocab-size,
the checkpoint's model.vocab_size, data.vocab_size for the built-in stdlib corpus (its tokenizer
is trained to exactly that size), the tokenizer of data.tokenizer_model when that file exists.
When none is known the padded size is kept and a warning says so.

Example:
    python tools/export_hf.py outputs/tiny/checkpoints hf/tiny

Exit codes: 0 written, 2 a bad argument (a --vocab-size below 1, above the checkpoint's padded
vocabulary or padding to another size; an OUT_DIR that cannot be written; a --tokenizer that is
missing, not a tokenizer or larger than the model's vocabulary), 3 a missing or
damaged checkpoint (or one that cannot be exported) or a write that failed. Each error is one
line on stderr; config.json, model.safetensors and each tokenizer file appear only complete.

An OUT_DIR that holds an earlier export or another model is overwritten: files that would
contradict the new model are removed (an earlier tokenizer, generation_config.json, whose token
ids transformers' generate would use, and sharded or pickled weights with their index).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
EXIT_ARGS = 2
EXIT_DATA = 3
EMBEDDING = "model/embedding.word.weight"


class ArgumentError(ValueError):
    """An argument that does not fit the checkpoint or cannot be used (exit 2)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    from megatronish.config.cli_errors import OneLineArgumentParser

    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint.dir or a step_XXXXXXX directory")
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory for config.json + safetensors")
    p.add_argument("--vocab-size", type=int, default=None, help="real vocabulary size (auto)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights dtype (float32)")
    p.add_argument("--verify", action="store_true", help="check every shard's CRC32 while reading")
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        default=None,
        help="tokenizer to write beside the model (sentencepiece .model, tokenizer.json or a "
        "directory holding one); default: the run's",
    )
    args = p.parse_args(argv)
    if args.vocab_size is not None and args.vocab_size < 1:
        p.error(f"--vocab-size {args.vocab_size} must be >= 1 (the real vocabulary size)")
    return args


def real_vocab_size(config: dict) -> int | None:
    """The real (unpadded) vocabulary of a run from its resolved config, or None if unknown."""
    model, data = config.get("model", {}), config.get("data") or {}
    if model.get("vocab_size"):
        return int(model["vocab_size"])
    if data.get("source") == "stdlib" and data.get("vocab_size"):
        return int(data["vocab_size"])
    path = data.get("tokenizer_model")
    if path and os.path.exists(os.path.expanduser(path)):
        from megatronish.data.tokenizer import load_tokenizer

        return load_tokenizer(path).vocab_size
    return None


def check_vocab_size(vocab: int, meta, step_dir: str) -> None:
    """Refuse a ``--vocab-size`` the checkpoint's padded embedding cannot have come from."""
    from megatronish.config.derived import pad_vocab

    if EMBEDDING not in meta.tensors:
        return  # to_hf says what is missing
    padded = meta.tensors[EMBEDDING].shape[0]
    multiple = meta.config["model"].get("make_vocab_size_divisible_by") or 128
    if vocab > padded or pad_vocab(vocab, multiple) != padded:
        raise ArgumentError(
            f"--vocab-size {vocab} does not fit {step_dir}: its embedding has {padded} rows "
            f"(padded to a multiple of {multiple}), so the real vocabulary is "
            f"{max(padded - multiple + 1, 1)}..{padded}"
        )


def check_out_dir(out_dir: str) -> None:
    """Refuse an OUT_DIR that is a file or cannot be created or written."""
    from megatronish.config.cli_errors import output_dir_error

    if (why := output_dir_error(out_dir, "OUT_DIR")) is not None:
        raise ArgumentError(why)


def export_tokenizer(meta, override: str | None, vocab: int | None):
    """``(tokenizer, None)`` to write beside the model: ``override`` (``--tokenizer``;
    ArgumentError when it cannot be used) or the run's; ``(None, why)`` when the run's cannot be.
    A tokenizer with more tokens than the model's ``vocab`` is not the model's."""
    from megatronish.data.tokenizer import load_tokenizer
    from megatronish.generate.tokenizer import run_tokenizer_path

    path = override or run_tokenizer_path(meta.config, meta.trainer)
    try:
        if path is None:
            raise FileNotFoundError("the checkpoint's config names no tokenizer")
        tok = load_tokenizer(path)
        if vocab is not None and tok.vocab_size > vocab:
            raise ValueError(
                f"{tok} has more tokens than the model's vocabulary ({vocab}): not its tokenizer"
            )
    except (FileNotFoundError, ValueError) as e:
        if override:
            raise ArgumentError(f"--tokenizer {override}: {e}") from None
        return None, str(e)
    return tok, None


def export(
    ckpt: str,
    out_dir: str,
    vocab_size: int | None = None,
    dtype: str = "float32",
    verify: bool = False,
    tokenizer: str | None = None,
) -> tuple[dict, str | None]:
    """Write ``out_dir/config.json``, ``out_dir/model.safetensors`` and the tokenizer's files
    (``tokenizer``, default the run's); returns the HF config and the line saying which
    tokenizer was written (None: none)."""
    import torch

    from megatronish.checkpoint.format import CheckpointError, read_metadata, resolve_step_dir
    from megatronish.checkpoint.shard_reader import ShardReader
    from megatronish.file_modes import save_safetensors, write_atomic
    from megatronish.hf.to_hf import replaced_files, to_hf
    from megatronish.hf.tokenizer_files import remove_tokenizer_files, write_tokenizer

    step_dir = resolve_step_dir(ckpt)
    meta = read_metadata(step_dir)
    if not isinstance(meta.config.get("model"), dict):
        raise CheckpointError(f"{step_dir}/metadata.json has no model config section")
    if vocab_size is not None:
        check_vocab_size(vocab_size, meta, step_dir)
    check_out_dir(out_dir)
    try:
        vocab = vocab_size or real_vocab_size(meta.config)
    except ValueError as e:  # the run's tokenizer file is not a model
        raise CheckpointError(f"{e}; pass --vocab-size") from None
    if vocab is None:
        print(
            "warning: the checkpoint does not record its real vocabulary size; keeping the padded "
            "vocabulary (pass --vocab-size to cut it)",
            file=sys.stderr,
        )
    padded = meta.tensors[EMBEDDING].shape[0] if EMBEDDING in meta.tensors else None
    tok, no_tokenizer = export_tokenizer(meta, tokenizer, vocab or padded)
    special = meta.tokenizer or (tok.special_token_ids() if tok is not None else None)
    reader = ShardReader(step_dir, meta, verify=verify)
    tensors = {
        name.removeprefix("model/"): reader.read(name)
        for name in meta.tensors
        if name.startswith("model/")
    }
    try:
        config, state = to_hf(
            tensors, meta.config["model"], vocab, getattr(torch, dtype), special_tokens=special
        )
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{step_dir} cannot be exported: {e}") from None
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    remove_tokenizer_files(out_dir)  # an earlier export's is never left beside this model
    for name in replaced_files(os.listdir(out_dir)):  # nor its generation_config.json, ...
        if os.path.isfile(path := os.path.join(out_dir, name)):
            os.remove(path)
    write_atomic(
        os.path.join(out_dir, "model.safetensors"),
        lambda p: save_safetensors(state, p, metadata={"format": "pt"}),
    )
    write_atomic(os.path.join(out_dir, "config.json"), lambda p: Path(p).write_text(text))
    if tok is None:
        print(
            f"warning: no tokenizer written: {no_tokenizer}; pass --tokenizer PATH to write one",
            file=sys.stderr,
        )
        return config, None
    return config, write_tokenizer(tok, out_dir)


def main(argv: list[str] | None = None) -> int:
    """Run the export; returns the exit code."""
    args = parse_args(argv)
    from safetensors import SafetensorError

    from megatronish.checkpoint.format import CheckpointError

    try:
        config, tokenizer = export(
            args.ckpt, args.out_dir, args.vocab_size, args.dtype, args.verify, args.tokenizer
        )
    except ArgumentError as e:
        print(f"invalid argument: {e}", file=sys.stderr)
        return EXIT_ARGS
    except (CheckpointError, SafetensorError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DATA
    except OSError as e:  # reading a shard, or writing OUT_DIR (a full disk)
        print(f"error: {e.filename or args.out_dir}: {e.strerror or e}", file=sys.stderr)
        return EXIT_DATA
    arch = config["architectures"][0]
    print(f"wrote {arch} (vocab {config['vocab_size']}, {config['dtype']}) to {args.out_dir}")
    if tokenizer is not None:
        print(f"wrote {tokenizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
