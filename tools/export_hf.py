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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint.dir or a step_XXXXXXX directory")
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory for config.json + safetensors")
    p.add_argument("--vocab-size", type=int, default=None, help="real vocabulary size (auto)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights dtype (float32)")
    p.add_argument("--verify", action="store_true", help="check every shard's CRC32 while reading")
    return p.parse_args(argv)


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


def export(ckpt: str, out_dir: str, vocab_size: int | None = None, dtype: str = "float32",
           verify: bool = False) -> dict:  # fmt: skip
    """Write ``out_dir/config.json`` and ``out_dir/model.safetensors``; returns the HF config."""
    import torch
    from safetensors.torch import save_file

    from megatronish.checkpoint.format import read_metadata, resolve_step_dir
    from megatronish.checkpoint.shard_reader import ShardReader
    from megatronish.hf.to_hf import to_hf

    step_dir = resolve_step_dir(ckpt)
    meta = read_metadata(step_dir)
    if "model" not in meta.config:
        raise ValueError(f"{step_dir}/metadata.json has no model config section")
    vocab = vocab_size or real_vocab_size(meta.config)
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
    config, state = to_hf(tensors, meta.config["model"], vocab, getattr(torch, dtype),
                          special_tokens=meta.tokenizer or None)  # fmt: skip
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return config


def _importable() -> None:
    """Let the tool run from a checkout without ``pip install -e .``."""
    try:
        import megatronish  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    """Run the export; returns the exit code."""
    args = parse_args(argv)
    try:
        _importable()
        from megatronish.checkpoint.format import CheckpointError

        config = export(args.ckpt, args.out_dir, args.vocab_size, args.dtype, args.verify)
    except (CheckpointError, ValueError, KeyError, OSError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    arch = config["architectures"][0]
    print(f"wrote {arch} (vocab {config['vocab_size']}, {config['dtype']}) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
