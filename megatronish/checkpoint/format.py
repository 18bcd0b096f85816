"""The checkpoint format: a directory of safetensors files described by ``metadata.json``.

``checkpoint.dir`` holds ``step_XXXXXXX/`` directories and a ``latest`` file naming the newest
published one. A step directory holds:

- ``metadata.json``: ``format_version``, ``step``, ``consumed_samples``, the resolved config, the
  layout that wrote it, trainer state, and for every tensor its global name, global shape, dtype
  and shards. A shard is a rectangle of the global tensor (``offsets``: ``[start, length]`` per
  dim) stored under ``key`` in ``file``, with a CRC32 of its bytes. ``files``: every other file
  of the step, its size in bytes and the CRC32 of each tensor no shard describes (the RNG and
  compression states; :mod:`~megatronish.checkpoint.rank_files`). ``crc32`` covers the rest
  of the file, so an edit or a flipped bit in it is refused.
- ``model-rankNNNNN.safetensors``: parameter shards (``model/<global name>``).
  The model's buffers (an expert bias of aux-loss-free balancing) are ``buffer/<global name>``,
  whole, in the model file of the stage's first tp, cp and dp rank.
- ``optim-rankNNNNN.safetensors``: Adam moments (``exp_avg/<name>``, ``exp_avg_sq/<name>``) in
  the same rectangles as the params, whatever the ZeRO stage that wrote them.
- ``rng-rankNNNNN.safetensors``: that rank's RNG states (restored when the layout is unchanged).
- ``compression-rankNNNNN.safetensors``: that rank's gradient-compression state (error feedback,
  PowerSGD's Q) under ``parallel.grad_compression``; restored when the layout is unchanged, else
  the run starts it from zero.

Tensors are keyed by global names (global layer indices), so any layout can read any checkpoint
by intersecting the rectangles it needs with the stored ones. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
BUFFER = "buffer/"  # the prefix of the model's buffers (not parameters) in ``tensors``
COMPRESSION = "compression"  # the per-rank file of the gradient compression's state


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit the config."""


@dataclass
class Shard:
    file: str
    key: str
    offsets: list[list[int]]  # [start, length] per dim of the global tensor
    crc32: int


@dataclass
class TensorEntry:
    shape: list[int]
    dtype: str
    shards: list[Shard] = field(default_factory=list)


@dataclass
class Metadata:
    format_version: int
    step: int
    consumed_samples: int
    layout: dict
    config: dict
    trainer: dict
    tensors: dict[str, TensorEntry]
    # The special token ids of the run's tokenizer, by their Hugging Face names (bos_token_id,
    # eos_token_id, pad_token_id); empty in checkpoints from before the field existed.
    tokenizer: dict = field(default_factory=dict)
    # Every file of the step besides metadata.json: {"bytes": size, "crc32": {key: CRC32 of
    # each tensor no shard entry describes}}; empty in checkpoints from before the field existed.
    files: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> str:
        """The JSON text, with ``crc32``: the CRC32 of the rest (see :func:`_crc_of`)."""
        raw = asdict(self)
        return json.dumps({**raw, "crc32": _crc_of(raw)}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, path: str = METADATA) -> Metadata:
        try:
            raw = json.loads(text)
            crc = raw.pop("crc32", None)  # absent in checkpoints from before the field existed
            if crc is not None and raw.get("format_version") == FORMAT_VERSION:
                _check_crc(raw, crc, path)
            tensors = {
                name: TensorEntry(e["shape"], e["dtype"], [Shard(**s) for s in e["shards"]])
                for name, e in raw["tensors"].items()
            }
            meta = cls(**{**raw, "tensors": tensors})
            if not all(isinstance(r, dict) for r in dict(meta.files).values()):
                raise ValueError("files: every entry must be an object")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path} is not a valid checkpoint metadata file: {e}") from e
        if meta.format_version != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has format version {meta.format_version}; this megatronish reads "
                f"version {FORMAT_VERSION}"
            )
        return meta


def _crc_of(raw: dict) -> int:
    """CRC32 of the compact, key-sorted JSON of ``raw``: independent of the file's layout, and
    fast (the C encoder; an indented dump is pure Python)."""
    return zlib.crc32(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode())


def _check_crc(raw: dict, stored: int, path: str) -> None:
    """Refuse metadata (``raw``, without its ``crc32``) changed after the save."""
    if _crc_of(raw) != stored:
        raise CheckpointError(
            f"{path} was changed after the save: it does not match its crc32 {stored}. Restore "
            "it, or load another step; if you edited it on purpose, delete its crc32 field"
        )


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:07d}"


def step_of(name: str) -> int | None:
    """The step of a ``step_XXXXXXX`` directory name (None for any other name)."""
    digits = name[len(STEP_PREFIX) :]
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


def crc32_of(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (contiguous, CPU)."""
    data = t.detach().contiguous().cpu()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return zlib.crc32(memoryview(np.ascontiguousarray(data.numpy())).cast("B"))


def latest_step_name(ckpt_dir: str) -> str | None:
    """The step directory name ``ckpt_dir/latest`` holds (None without a ``latest`` file).

    Raises :class:`CheckpointError` when it cannot be read or holds anything else (text or
    bytes that are not a ``step_XXXXXXX`` name, which could also point outside ``ckpt_dir``).
    """
    path = os.path.join(ckpt_dir, LATEST)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e})") from e
    name = raw.decode("utf-8", errors="replace").strip()
    if step_of(name) is None:
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise CheckpointError(  # ascii(): bytes that are not text stay on one printable line
            f"{path} holds {ascii(shown)}, not a step directory name (step_XXXXXXX)"
        )
    return name


def resolve_step_dir(path: str) -> str:
    """A step directory from ``path``: a step directory itself, or a dir with ``latest``."""
    path = os.path.expanduser(path)
    if os.path.exists(os.path.join(path, METADATA)):
        return path
    try:
        name = latest_step_name(path)
    except CheckpointError as e:
        raise CheckpointError(
            f"{e}; pass one step directory, or write the newest step's name into it"
        ) from None
    if name is not None:
        step_dir = os.path.join(path, name)
        if os.path.exists(os.path.join(step_dir, METADATA)):
            return step_dir
        latest = os.path.join(path, LATEST)
        raise CheckpointError(f"{latest} names {step_dir}, which has no {METADATA}")
    raise CheckpointError(
        f"no checkpoint at {path}: expected {METADATA} or a '{LATEST}' file; pass a "
        "checkpoint.dir or one of its step_XXXXXXX directories"
    )


def read_metadata(step_dir: str) -> Metadata:
    path = os.path.join(step_dir, METADATA)
    try:
        with open(path, encoding="utf-8") as f:
            return Metadata.from_json(f.read(), path)
    except (OSError, UnicodeDecodeError) as e:  # missing, unreadable, or bytes that are not text
        raise CheckpointError(f"cannot read {path}: {e}") from e
