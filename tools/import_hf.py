"""Import a local Hugging Face Llama / Mixtral / Qwen3 / Qwen3-MoE / GPT-2 model as a weights-only
megatronish checkpoint.

HF_DIR holds config.json and model.safetensors (or model.safetensors.index.json with its
shards); nothing is downloaded and pickled ``pytorch_model.bin`` files are refused. CKPT_DIR
gets ``step_0000000/`` (metadata.json with the model config and ``optimizer_steps: 0``, one
safetensors file of fp32 ``model/<name>`` tensors with CRC32s) and ``latest``. Pretraining
continues from it with fresh Adam state in any layout:

    python tools/import_hf.py hf/my-llama ckpt/my-llama
    python -m megatronish.train checkpoint.resume=ckpt/my-llama <printed model.* overrides> ...

The vocabulary is padded with zero rows to a multiple of 128; the training data must use the HF
model's tokenizer ids (model.vocab_size is set to the HF vocabulary). When HF_DIR holds its
tokenizer (tokenizer.json, or a sentencepiece tokenizer.model) the printed commands tokenize the
data with it and train with data.tokenizer_model=HF_DIR; a tokenizer that cannot be used (no eos
token, more tokens than the model's vocabulary) gets a warning line, not a failure.

Exit codes: 0 written, 2 a bad argument (--seq-length below 1 or beyond the model's positions,
a CKPT_DIR that holds checkpoints without --force or cannot be written), 3 bad or missing input
(no HF_DIR, config.json or safetensors; a truncated or unreadable file; a model megatronish
cannot represent) or a write that failed. Each error is one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

EXIT_ARGS = 2
EXIT_DATA = 3


class ArgumentError(ValueError):
    """An argument that cannot be used (exit 2)."""


class InputError(ValueError):
    """The HF model directory is missing, unreadable or not a model megatronish can hold."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    from megatronish.config.cli_errors import OneLineArgumentParser

    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("hf_dir", metavar="HF_DIR", help="local HF model directory")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="checkpoint directory to create")
    p.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="model.seq_length to record (default: the HF model's max positions)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace the checkpoints already in CKPT_DIR"
    )
    args = p.parse_args(argv)
    if args.seq_length is not None and args.seq_length < 1:
        p.error(f"--seq-length {args.seq_length} must be >= 1 (tokens per sample)")
    return args


def read_json(path: str, what: str) -> dict:
    """A JSON object file; :class:`InputError` naming it when it is missing or not one."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{path} does not exist; {what}") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{path} is not readable JSON ({e}); re-download or fix it") from None
    if not isinstance(value, dict):
        raise InputError(f"{path} holds a {type(value).__name__}, not a JSON object; {what}")
    return value


def _shard_files(hf_dir: str) -> list[str]:
    single = os.path.join(hf_dir, "model.safetensors")
    index = single + ".index.json"
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        weight_map = read_json(index, "it maps tensors to files").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{index} has no weight_map of tensor names to files; fix it")
        return [os.path.join(hf_dir, str(name)) for name in sorted(set(weight_map.values()))]
    raise InputError(
        f"{hf_dir} has no model.safetensors (or model.safetensors.index.json); pickled "
        "weights are not read: convert them to safetensors first"
    )


def read_hf_dir(hf_dir: str) -> tuple[dict, dict]:
    """``(config, state dict)`` of a local HF model directory (safetensors only); raises
    :class:`InputError` naming what is missing or unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isdir(hf_dir):
        raise InputError(f"HF_DIR {hf_dir} is not a directory; give a local HF model directory")
    config = read_json(os.path.join(hf_dir, "config.json"), "an HF model directory has one")
    state = {}
    for path in _shard_files(hf_dir):
        try:
            state.update(load_file(path))
        except FileNotFoundError:
            raise InputError(f"{path} does not exist; the index names it: copy it there") from None
        except (SafetensorError, OSError, ValueError) as e:
            raise InputError(
                f"{path} is not a readable safetensors file ({e}); it may be truncated: "
                "re-download it"
            ) from None
    return config, state


def write_checkpoint(
    ckpt_dir: str, model_cfg: dict, tensors: dict, source: str, special_tokens: dict | None = None
) -> str:
    """Publish ``tensors`` as the weights-only step 0 of ``ckpt_dir``; returns the step dir."""
    from megatronish.checkpoint.format import TMP_PREFIX, step_dir_name
    from megatronish.checkpoint.save import merge_and_publish, write_rank_files

    tmp_dir = os.path.join(ckpt_dir, TMP_PREFIX + step_dir_name(0))
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    group, index = {}, []
    for name, t in tensors.items():
        key = f"model/{name}"
        group[key] = t
        index.append(
            {
                "name": key,
                "key": key,
                "offsets": [[0, n] for n in t.shape],
                "shape": list(t.shape),
                "dtype": "float32",
                "file": "model",
            }
        )
    try:
        write_rank_files(tmp_dir, 0, {"model": group}, index)
    except BaseException:  # a full disk: nothing half-written stays behind
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    header = {
        "step": 0,
        "consumed_samples": 0,
        "layout": {
            "tp": 1,
            "pp": 1,
            "dp": 1,
            "vpp": 1,
            "sp": False,
            "zero_stage": 0,
            "world_size": 1,
        },
        "config": {"model": model_cfg},
        "trainer": {
            "optimizer_steps": 0,
            "skipped_steps": 0,
            "run_id": None,
            "imported_from": os.path.abspath(source),
        },
        "tokenizer": dict(special_tokens or {}),
    }
    return merge_and_publish(ckpt_dir, tmp_dir, 0, 1, header, keep_last=None)


def existing_checkpoints(ckpt_dir: str) -> list[str]:
    """Published steps and ``latest`` already in ``ckpt_dir``."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step_") or d == "latest")


def special_tokens_of(hf_config: dict) -> dict:
    """The special token ids an HF ``config.json`` declares (eos may be a list of ids)."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: hf_config[k] for k in keys if hf_config.get(k) is not None}


def check_ckpt_dir(ckpt_dir: str, force: bool) -> list[str]:
    """The checkpoints already in ``ckpt_dir`` (to replace with ``force``); raises
    :class:`ArgumentError` when it holds some without ``force`` or cannot be written."""
    from megatronish.config.cli_errors import output_dir_error

    found = existing_checkpoints(ckpt_dir)
    if found and not force:
        raise ArgumentError(f"{ckpt_dir} already holds {found}; pass --force to replace them")
    if (why := output_dir_error(ckpt_dir, "CKPT_DIR")) is not None:
        raise ArgumentError(why)
    return found


def convert(config: dict, state: dict, seq_length: int | None) -> tuple[dict, dict]:
    """:func:`~megatronish.hf.from_hf.from_hf`, with its errors as :class:`InputError` (the
    model) or :class:`ArgumentError` (``seq_length``)."""
    from megatronish.hf.from_hf import from_hf

    positions = config.get("max_position_embeddings", config.get("n_positions"))
    if seq_length is not None and isinstance(positions, int) and seq_length > positions:
        raise ArgumentError(
            f"--seq-length {seq_length} exceeds the model's {positions} positions "
            "(max_position_embeddings); use at most that"
        )
    try:
        return from_hf(config, state, seq_length)
    except KeyError as e:
        raise InputError(
            f"config.json has no {e} (model_type {config.get('model_type')!r})"
        ) from None
    except (ValueError, TypeError, RuntimeError) as e:
        raise InputError(f"cannot convert the model: {e}") from None


def import_hf(
    hf_dir: str, ckpt_dir: str, seq_length: int | None = None, force: bool = False
) -> tuple[dict, str]:
    """Convert ``hf_dir`` into ``ckpt_dir``; returns ``(model config, step dir)``."""
    ckpt_dir = os.path.expanduser(ckpt_dir)
    found = check_ckpt_dir(ckpt_dir, force)
    config, state = read_hf_dir(os.path.expanduser(hf_dir))
    model_cfg, tensors = convert(config, state, seq_length)
    step_dir = write_checkpoint(ckpt_dir, model_cfg, tensors, hf_dir, special_tokens_of(config))
    for name in found:  # replaced only once the new step is published
        path = os.path.join(ckpt_dir, name)
        if path != step_dir and name != "latest":
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return model_cfg, step_dir


def usable_tokenizer(hf_dir: str, vocab: int):
    """``(path, tokenizer)`` of the tokenizer in ``hf_dir`` for ``data.tokenizer_model``, or
    None when it has none, or one that cannot be used with the model (a warning line says why)."""
    from megatronish.data.tokenizer import load_tokenizer, tokenizer_in

    path = tokenizer_in(os.path.expanduser(hf_dir))
    if path is None:
        return None
    try:
        tok = load_tokenizer(path)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"warning: the model's tokenizer cannot be used: {e}", file=sys.stderr)
        return None
    if tok.vocab_size > vocab:
        print(
            f"warning: {tok} has {tok.vocab_size} tokens, more than the model's vocabulary "
            f"({vocab}): ids from {vocab} on have no embedding; tokenize the data with the "
            "tokenizer the model was trained with",
            file=sys.stderr,
        )
        return None
    return (hf_dir if os.path.isdir(path) else path), tok


def print_next_steps(ckpt_dir: str, model_cfg: dict, tokenizer) -> None:
    """The commands that continue pretraining from the import (with the model's tokenizer)."""
    from megatronish.hf.common import override_args

    data = []
    if tokenizer is not None:
        path, tok = tokenizer
        print(
            f"tokenize the data with the model's tokenizer ({tok.vocab_size} tokens, "
            f"end-of-document id {tok.eod_id}):"
        )
        print(f"  python tools/preprocess_data.py --input DATA.jsonl --tokenizer-model {path} \\")
        print("    --output-prefix data/corpus")
        data = ["data=indexed", "data.prefix=data/corpus", f"data.tokenizer_model={path}"]
        print("continue pretraining with these model overrides:")
    else:
        print(
            "continue pretraining with these model overrides (and data tokenized like the HF "
            "model):"
        )
    print(f"  python -m megatronish.train checkpoint.resume={ckpt_dir} \\")
    print("    " + " ".join([*override_args(model_cfg), *data]))
    print(f"(or checkpoint.dir={ckpt_dir} instead of checkpoint.resume: new checkpoints are")
    print(" saved next to it and a restart resumes the newest)")


def main(argv: list[str] | None = None) -> int:
    """Run the import; returns the exit code."""
    args = parse_args(argv)
    try:
        model_cfg, step_dir = import_hf(args.hf_dir, args.ckpt_dir, args.seq_length, args.force)
    except ArgumentError as e:
        print(f"invalid argument: {e}", file=sys.stderr)
        return EXIT_ARGS
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DATA
    except OSError as e:  # writing the checkpoint: a full disk, a file size limit
        print(
            f"error: writing the checkpoint into {args.ckpt_dir} failed ({e.strerror or e}); "
            "nothing was published: free space and run it again",
            file=sys.stderr,
        )
        return EXIT_DATA
    print(f"wrote {step_dir} (weights only, step 0)")
    tokenizer = usable_tokenizer(args.hf_dir, model_cfg["vocab_size"])
    print_next_steps(args.ckpt_dir, model_cfg, tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
