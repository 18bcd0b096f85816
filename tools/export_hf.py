"""Export a megatronish checkpoint as a Hugging Face model directory (config.json + safetensors).

CKPT is a checkpoint.dir (its ``latest`` step) or one step_XXXXXXX directory, saved with any
layout (tensors are stored globally). llama exports as LlamaForCausalLM, gpt2 as GPT2LMHeadModel,
a llama mixture of experts (every block, no shared experts) as MixtralForCausalLM;
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads the result. Only the weights are
exported (no optimizer state, no tokenizer).

The vocabulary padding is cut to the real vocabulary size, found in this order: --vocab-size,
the checkpoint's model.vocab_size, data.vocab_size for the built-in stdlib corpus (its tokenizer
is trained to exactly that size), the tokenizer of data.tokenizer_model when that file exists.
When none is known the padded size is kept and a warning says so.

Example:
    python tools/export_hf.py outputs/tiny/checkpoints hf/tiny

Exit codes: 0 written, 2 a bad argument (a --vocab-size below 1, above the checkpoint's padded
vocabulary or padding to another size; an OUT_DIR that cannot be written), 3 a missing or
damaged checkpoint (or one that cannot be exported) or a write that failed. Each error is one
line on stderr; config.json and model.safetensors appear only complete.
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


def _importable() -> None:
    """Let the tool run from a checkout without ``pip install -e .``."""
    try:
        import megatronish  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    _importable()
    from megatronish.config.cli_errors import OneLineArgumentParser

    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint.dir or a step_XXXXXXX directory")
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory for config.json + safetensors")
    p.add_argument("--vocab-size", type=int, default=None, help="real vocabulary size (auto)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights dtype (float32)")
    p.add_argument("--verify", action="store_true", help="check every shard's CRC32 while reading")
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
    if path and os.path.isfile(os.path.expanduser(path)):
        from megatronish.data.tokenizer import Tokenizer

        return Tokenizer(path).vocab_size
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


def _write_atomic(path: str, write) -> None:
    """``write(tmp_path)``, then rename it to ``path`` (removed on failure)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def export(ckpt: str, out_dir: str, vocab_size: int | None = None, dtype: str = "float32",
           verify: bool = False) -> dict:  # fmt: skip
    """Write ``out_dir/config.json`` and ``out_dir/model.safetensors``; returns the HF config."""
    import torch
    from safetensors.torch import save_file

    from megatronish.checkpoint.format import CheckpointError, read_metadata, resolve_step_dir
    from megatronish.checkpoint.shard_reader import ShardReader
    from megatronish.hf.to_hf import to_hf

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
    reader = ShardReader(step_dir, meta, verify=verify)
    tensors = {
        name.removeprefix("model/"): reader.read(name)
        for name in meta.tensors
        if name.startswith("model/")
    }
    try:
        config, state = to_hf(tensors, meta.config["model"], vocab, getattr(torch, dtype),
                              special_tokens=meta.tokenizer or None)  # fmt: skip
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{step_dir} cannot be exported: {e}") from None
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    _write_atomic(os.path.join(out_dir, "model.safetensors"),
                  lambda p: save_file(state, p, metadata={"format": "pt"}))  # fmt: skip
    _write_atomic(os.path.join(out_dir, "config.json"), lambda p: Path(p).write_text(text))
    return config


def main(argv: list[str] | None = None) -> int:
    """Run the export; returns the exit code."""
    args = parse_args(argv)
    from safetensors import SafetensorError

    from megatronish.checkpoint.format import CheckpointError

    try:
        config = export(args.ckpt, args.out_dir, args.vocab_size, args.dtype, args.verify)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
