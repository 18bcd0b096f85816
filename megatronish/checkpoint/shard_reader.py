"""Reading rectangles of a checkpoint's global tensors from its shard files (any layout).

:class:`ShardReader` is what a load, a reshard and the export tools read with: it intersects
the rectangles a rank needs with the stored shards listed in ``metadata.json``
(:mod:`~megatronish.checkpoint.format`) and reads them by byte range from the safetensors files
(:mod:`~megatronish.checkpoint.shardfile`), in parallel and optionally checking each shard's CRC32.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from megatronish.checkpoint.format import CheckpointError, Metadata, TensorEntry, crc32_of
from megatronish.checkpoint.shardfile import (
    Piece,
    ShardFile,
    Staging,
    StoredTensor,
    piece,
    split_runs,
)
from megatronish.distributed.cpus import usable_cpus

READ_THREADS = min(4, usable_cpus())  # threads reading a load, one run of pieces each


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

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _open(self, file: str) -> ShardFile:
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


def _whole(src: tuple[slice, ...], stored: StoredTensor) -> bool:
    """Whether region ``src`` is all of ``stored``."""
    return all(s.start == 0 and s.stop == n for s, n in zip(src, stored.shape))
