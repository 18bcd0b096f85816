"""The checkpoint format: a directory of safetensors files described by ``metadata.json``.

``checkpoint.dir`` holds ``step_XXXXXXX/`` directories and a ``latest`` file naming the newest
published one. A step directory holds:

- ``metadata.json``: ``format_version``, ``step``, ``consumed_samples``, the resolved config, the
  layout that wrote it, trainer state, and for every tensor its global name, global shape, dtype
  and shards. A shard is a rectangle of the global tensor (``offsets``: ``[start, length]`` per
  dim) stored under ``key`` in ``file``, with a CRC32 of its bytes.
- ``model-rankNNNNN.safetensors``: parameter shards (``model/<global name>``).
- ``optim-rankNNNNN.safetensors``: Adam moments (``exp_avg/<name>``, ``exp_avg_sq/<name>``) in
  the same rectangles as the params, whatever the ZeRO stage that wrote them.
- ``rng-rankNNNNN.safetensors``: that rank's RNG states (restored when the layout is unchanged).

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
from safetensors import safe_open

FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"


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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, path: str = METADATA) -> Metadata:
        try:
            raw = json.loads(text)
            tensors = {
                name: TensorEntry(e["shape"], e["dtype"], [Shard(**s) for s in e["shards"]])
                for name, e in raw["tensors"].items()
            }
            meta = cls(**{**raw, "tensors": tensors})
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path} is not a valid checkpoint metadata file: {e}") from e
        if meta.format_version != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has format version {meta.format_version}; this megatronish reads "
                f"version {FORMAT_VERSION}"
            )
        return meta


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:07d}"


def crc32_of(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (contiguous, CPU)."""
    data = t.detach().contiguous().cpu()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return zlib.crc32(memoryview(np.ascontiguousarray(data.numpy())).cast("B"))


def resolve_step_dir(path: str) -> str:
    """A step directory from ``path``: a step directory itself, or a dir with ``latest``."""
    path = os.path.expanduser(path)
    if os.path.exists(os.path.join(path, METADATA)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.exists(latest):
        with open(latest) as f:
            step_dir = os.path.join(path, f.read().strip())
        if os.path.exists(os.path.join(step_dir, METADATA)):
            return step_dir
        raise CheckpointError(f"{latest} names {step_dir}, which has no {METADATA}")
    raise CheckpointError(
        f"no checkpoint at {path}: expected {METADATA} or a '{LATEST}' file; pass a "
        "checkpoint.dir or one of its step_XXXXXXX directories"
    )


def read_metadata(step_dir: str) -> Metadata:
    path = os.path.join(step_dir, METADATA)
    try:
        with open(path) as f:
            return Metadata.from_json(f.read(), path)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


class ShardReader:
    """Reads rectangles of global tensors, opening each safetensors file once."""

    def __init__(self, step_dir: str, meta: Metadata, verify: bool = False):
        self.step_dir, self.meta, self.verify = step_dir, meta, verify
        self._files: dict[str, object] = {}

    def _open(self, file: str):
        if file not in self._files:
            path = os.path.join(self.step_dir, file)
            try:
                self._files[file] = safe_open(path, framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises several types
                raise CheckpointError(f"cannot open {path}: {e}") from e
        return self._files[file]

    def read(
        self, name: str, offsets: list[list[int]] | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The rectangle ``offsets`` (default: all) of global tensor ``name``, written into
        ``out`` when given (any device; shaped like the rectangle)."""
        entry = self.meta.tensors.get(name)
        if entry is None:
            raise CheckpointError(f"{self.step_dir} has no tensor {name!r}")
        offsets = offsets or [[0, n] for n in entry.shape]
        if out is None:
            out = torch.empty([n for _, n in offsets], dtype=getattr(torch, entry.dtype))
        covered = 0
        for shard in entry.shards:
            lo = [max(a, s) for (a, _), (s, _) in zip(offsets, shard.offsets)]
            hi = [min(a + n, s + m) for (a, n), (s, m) in zip(offsets, shard.offsets)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            src = tuple(slice(low - s, h - s) for low, h, (s, _) in zip(lo, hi, shard.offsets))
            dst = tuple(slice(low - a, h - a) for low, h, (a, _) in zip(lo, hi, offsets))
            f = self._open(shard.file)
            if self.verify:
                whole = f.get_tensor(shard.key)
                if crc32_of(whole) != shard.crc32:
                    raise CheckpointError(
                        f"checksum mismatch in {shard.file} ({shard.key}): the file is corrupt"
                    )
                out[dst] = whole[src]
            elif all(h - low == m for low, h, (_, m) in zip(lo, hi, shard.offsets)):
                out[dst] = f.get_tensor(shard.key)  # the whole shard: one read, no slicing
            else:
                out[dst] = f.get_slice(shard.key)[src]
            covered += int(np.prod([h - low for low, h in zip(lo, hi)]))
        if covered != out.numel():
            raise CheckpointError(f"{self.step_dir}: the shards of {name!r} do not cover {offsets}")
        return out
