"""The checkpoint format: a directory of safetensors files described by ``metadata.json``.

``checkpoint.dir`` holds ``step_XXXXXXX/`` directories and a ``latest`` file naming the newest
published one. A step directory holds:

- ``metadata.json``: ``format_version``, ``step``, ``consumed_samples``, the resolved config, the
  layout that wrote it, trainer state, and for every tensor its global name, global shape, dtype
  and shards. A shard is a rectangle of the global tensor (``offsets``: ``[start, length]`` per
  dim) stored under ``key`` in ``file``, with a CRC32 of its bytes. ``crc32`` covers the rest
  of the file, so an edit or a flipped bit in it is refused.
- ``model-rankNNNNN.safetensors``: parameter shards (``model/<global name>``).
- ``optim-rankNNNNN.safetensors``: Adam moments (``exp_avg/<name>``, ``exp_avg_sq/<name>``) in
  the same rectangles as the params, whatever the ZeRO stage that wrote them.
- ``rng-rankNNNNN.safetensors``: that rank's RNG states (restored when the layout is unchanged).

Tensors are keyed by global names (global layer indices), so any layout can read any checkpoint
by intersecting the rectangles it needs with the stored ones. Nothing is pickled.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # shardfile imports this module (imported lazily below)
    from megatronish.checkpoint.shardfile import Piece, ShardFile, Staging

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
    # The special token ids of the run's tokenizer, by their Hugging Face names (bos_token_id,
    # eos_token_id, pad_token_id); empty in checkpoints from before the field existed.
    tokenizer: dict = field(default_factory=dict)

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


READ_THREADS = min(4, os.cpu_count() or 1)  # threads reading a load, one run of pieces each


class ShardReader:
    """Reads rectangles of global tensors, opening each safetensors file once.

    Shards are read by byte range (see ``shardfile.py``): straight into a contiguous CPU
    destination, otherwise through a reused staging buffer, by ``threads`` threads that each
    read one contiguous run of the pieces in file order. Use it as a context manager (or call
    :meth:`close`) to close the files.
    """

    def __init__(
        self, step_dir: str, meta: Metadata, verify: bool = False, threads: int = READ_THREADS
    ):
        self.step_dir, self.meta, self.verify = step_dir, meta, verify
        self.threads = max(1, threads)
        self._files: dict[str, ShardFile] = {}
        self._stagings: list[Staging] = []  # one reused staging buffer per reading thread
        self._verified: set[tuple[str, str]] = set()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _open(self, file: str) -> ShardFile:
        from megatronish.checkpoint.shardfile import ShardFile

        if file not in self._files:
            self._files[file] = ShardFile(os.path.join(self.step_dir, file))
        return self._files[file]

    def read(
        self, name: str, offsets: list[list[int]] | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The rectangle ``offsets`` (default: all) of global tensor ``name``, written into
        ``out`` when given (any device, dtype and strides; shaped like the rectangle)."""
        if out is None:
            entry = self._entry(name)
            shape = [n for _, n in offsets] if offsets else entry.shape
            out = torch.empty(shape, dtype=getattr(torch, entry.dtype))
        self.read_many([(name, offsets, out)])
        return out

    def read_many(self, requests: list[tuple[str, list[list[int]] | None, torch.Tensor]]) -> None:
        """Fill the ``out`` of every ``(name, offsets, out)`` request as :meth:`read` does.

        The pieces are sorted in file and byte order and split into ``threads`` runs of about
        equal bytes, read concurrently (each run sequentially); with ``verify`` each shard's
        CRC32 is checked by the thread that read it, before this returns.
        """
        from megatronish.checkpoint.shardfile import Staging, split_runs

        pieces = [piece for request in requests for piece in self._pieces(*request)]
        pieces.sort(key=lambda piece: (piece.file.path, piece.offset))
        runs = split_runs(pieces, self.threads)
        while len(self._stagings) < len(runs):
            self._stagings.append(Staging())
        if len(runs) == 1:
            self._read_run(runs[0], self._stagings[0])
            return
        with ThreadPoolExecutor(len(runs), thread_name_prefix="shard-reader") as pool:
            for done in [pool.submit(self._read_run, r, st) for r, st in zip(runs, self._stagings)]:
                done.result()  # re-raises a reading thread's error

    @torch.no_grad()  # grad mode is per thread: a reading thread starts with it on
    def _read_run(self, pieces: list[Piece], staging: Staging) -> None:
        for f, shard, src, view, _, _ in pieces:
            if not self.verify or (shard.file, shard.key) in self._verified:
                f.read_region(shard.key, src, view, staging)
                continue
            stored = f.stored(shard.key)
            if _whole(src, stored) and view.dtype == stored.dtype:  # check it where it lies
                f.read_region(shard.key, src, view, staging)
                data = view
            else:
                data = f.read_whole(shard.key, staging)
            if crc32_of(data) != shard.crc32:
                raise CheckpointError(
                    f"checksum mismatch in {shard.file} ({shard.key}): the file is corrupt"
                )
            if data is not view:
                view.copy_(data[src])
            self._verified.add((shard.file, shard.key))

    def _entry(self, name: str) -> TensorEntry:
        entry = self.meta.tensors.get(name)
        if entry is None:
            raise CheckpointError(f"{self.step_dir} has no tensor {name!r}")
        return entry

    def _pieces(self, name: str, offsets: list[list[int]] | None, out: torch.Tensor) -> list[Piece]:
        """A :class:`Piece` for every stored shard that meets rectangle ``offsets`` of ``name``."""
        from megatronish.checkpoint.shardfile import piece

        entry = self._entry(name)
        offsets = offsets or [[0, n] for n in entry.shape]
        pieces, covered = [], 0
        for shard in entry.shards:
            lo = [max(a, s) for (a, _), (s, _) in zip(offsets, shard.offsets)]
            hi = [min(a + n, s + m) for (a, n), (s, m) in zip(offsets, shard.offsets)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            src = tuple(slice(low - s, h - s) for low, h, (s, _) in zip(lo, hi, shard.offsets))
            dst = tuple(slice(low - a, h - a) for low, h, (a, _) in zip(lo, hi, offsets))
            f = self._open(shard.file)
            stored = f.stored(shard.key)
            if list(stored.shape) != [m for _, m in shard.offsets]:
                raise CheckpointError(
                    f"{shard.file}: {shard.key} is {list(stored.shape)}, but metadata.json "
                    f"says {shard.offsets}; the checkpoint is damaged"
                )
            size = math.prod(h - low for low, h in zip(lo, hi))
            view = out if size == out.numel() else out[dst]
            pieces.append(piece(f, shard, src, view))
            covered += size
        if covered != out.numel():
            raise CheckpointError(f"{self.step_dir}: the shards of {name!r} do not cover {offsets}")
        return pieces


def _whole(src: tuple[slice, ...], stored) -> bool:
    """Whether region ``src`` is all of ``stored``."""
    return all(s.start == 0 and s.stop == n for s, n in zip(src, stored.shape))
