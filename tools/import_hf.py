"""Import a local Hugging Face Llama / Mixtral / GPT-2 model as a weights-only megatronish
checkpoint.

HF_DIR holds config.json and model.safetensors (or model.safetensors.index.json with its
shards); nothing is downloaded and pickled ``pytorch_model.bin`` files are refused. CKPT_DIR
gets ``step_0000000/`` (metadata.json with the model config and ``optimizer_steps: 0``, one
safetensors file of fp32 ``model/<name>`` tensors with CRC32s) and ``latest``. Pretraining
continues from it with fresh Adam state in any layout:

    python tools/import_hf.py hf/my-llama ckpt/my-llama
    python -m megatronish.train checkpoint.resume=ckpt/my-llama <printed model.* overrides> ...

The vocabulary is padded with zero rows to a multiple of 128; the training data must use the HF
model's tokenizer ids (model.vocab_size is set to the HF vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("hf_dir", metavar="HF_DIR", help="local HF model directory")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="checkpoint directory to create")
    p.add_argument(
        "--seq-length", type=int, default=None,
        help="model.seq_length to record (default: the HF model's max positions)",
    )  # fmt: skip
    p.add_argument(
        "--force", action="store_true", help="replace the checkpoints already in CKPT_DIR"
    )
    return p.parse_args(argv)


def read_hf_dir(hf_dir: str) -> tuple[dict, dict]:
    """``(config, state dict)`` of a local HF model directory (safetensors only)."""
    from safetensors.torch import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    single = os.path.join(hf_dir, "model.safetensors")
    index = single + ".index.json"
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(hf_dir, name) for name in sorted(set(weight_map.values()))]
    else:
        raise FileNotFoundError(
            f"{hf_dir} has no model.safetensors (or model.safetensors.index.json); pickled "
            "weights are not read: convert them to safetensors first"
        )
    state = {}
    for path in files:
        state.update(load_file(path))
    return config, state


def write_checkpoint(ckpt_dir: str, model_cfg: dict, tensors: dict, source: str,
                     special_tokens: dict | None = None) -> str:  # fmt: skip
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
        index.append({"name": key, "key": key, "offsets": [[0, n] for n in t.shape],
                      "shape": list(t.shape), "dtype": "float32", "file": "model"})  # fmt: skip
    write_rank_files(tmp_dir, 0, {"model": group}, index)
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
        },  # fmt: skip
        "config": {"model": model_cfg},
        "trainer": {
            "optimizer_steps": 0,
            "skipped_steps": 0,
            "run_id": None,
            "imported_from": os.path.abspath(source),
        },  # fmt: skip
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


def import_hf(hf_dir: str, ckpt_dir: str, seq_length: int | None = None,
              force: bool = False) -> tuple[dict, str]:  # fmt: skip
    """Convert ``hf_dir`` into ``ckpt_dir``; returns ``(model config, step dir)``."""
    from megatronish.hf.from_hf import from_hf

    ckpt_dir = os.path.expanduser(ckpt_dir)
    found = existing_checkpoints(ckpt_dir)
    if found and not force:
        raise FileExistsError(f"{ckpt_dir} already holds {found}; pass --force to replace them")
    config, state = read_hf_dir(os.path.expanduser(hf_dir))
    model_cfg, tensors = from_hf(config, state, seq_length)
    os.makedirs(ckpt_dir, exist_ok=True)
    for name in found:
        path = os.path.join(ckpt_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    step_dir = write_checkpoint(ckpt_dir, model_cfg, tensors, hf_dir, special_tokens_of(config))
    return model_cfg, step_dir


def _importable() -> None:
    """Let the tool run from a checkout without ``pip install -e .``."""
    try:
        import megatronish  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    """Run the import; returns the exit code."""
    args = parse_args(argv)
    _importable()
    from megatronish.hf.common import override_args

    try:
        model_cfg, step_dir = import_hf(args.hf_dir, args.ckpt_dir, args.seq_length, args.force)
    except (ValueError, KeyError, OSError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {step_dir} (weights only, step 0)")
    print("continue pretraining with these model overrides (and data tokenized like the HF model):")
    print(f"  python -m megatronish.train checkpoint.resume={args.ckpt_dir} \\")
    print("    " + " ".join(override_args(model_cfg)))
    print(f"(or checkpoint.dir={args.ckpt_dir} instead of checkpoint.resume: new checkpoints are")
    print(" saved next to it and a restart resumes the newest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
