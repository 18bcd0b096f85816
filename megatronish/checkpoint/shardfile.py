"""Reading byte ranges of tensors in a safetensors file straight into their destination.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's
``dtype``, ``shape`` and ``data_offsets`` (``[begin, end)`` relative to the end of the header),
then the raw row-major bytes. A rectangle of a stored tensor whose elements are one contiguous
run of bytes is read with one positional read (``preadv``) directly into a contiguous CPU
destination of the same dtype: one kernel copy, no mapped pages, no intra-op threads. Anything
else (a tp-sliced rectangle, another dtype or device) goes through a reused staging buffer, a
slab of rows at a time, and one ``copy_`` into the destination. A file too short for what its
header promises raises a :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from megatronish.checkpoint.format import CheckpointError, Shard

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 << 20  # bytes; safetensors itself refuses larger headers
STAGING_SLAB = 32 << 20  # bytes of file read per staged slab (a longer single row still fits)


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are in its file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the first element in the file
    strides: tuple[int, ...] = field(init=False)  # row-major, in elements

    def __post_init__(self) -> None:
        strides, step = [], 1
        for n in reversed(self.shape):
            strides.append(step)
            step *= n
        object.__setattr__(self, "strides", tuple(reversed(strides)))


def parse_header(header: bytes, file_size: int, path: str) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file from its JSON header, checked against the file size.

    ``header`` is the JSON text (without the 8-byte length). A tensor whose bytes end past
    ``file_size`` means a truncated file, and is refused with a :class:`CheckpointError`.
    """
    base = 8 + len(header)
    try:
        raw = json.loads(header)
        tensors = {}
        for key, e in raw.items():
            if key == "__metadata__":
                continue
            dtype, shape, (begin, end) = DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
            nbytes = math.prod(shape) * dtype.itemsize
            if end - begin != nbytes or begin < 0:
                raise ValueError(f"{key}: data_offsets {[begin, end]} do not hold {nbytes} bytes")
            if base + end > file_size:
                raise CheckpointError(
                    f"{path} is truncated: {key} ends at byte {base + end} but the file has "
                    f"{file_size} bytes. The checkpoint is damaged; load another step "
                    "(checkpoint.resume=PATH)."
                )
            tensors[key] = StoredTensor(dtype, shape, base + begin)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} has an invalid safetensors header: {e!r}") from e
    return tensors


class Piece(NamedTuple):
    """Region ``src`` of one stored shard, to be read into ``out``."""

    file: ShardFile
    shard: Shard
    src: tuple[slice, ...]
    out: torch.Tensor
    offset: int  # the file offset of the region's first byte
    span: int  # bytes from the region's first byte to its last (what reading it takes)


def piece(file: ShardFile, shard: Shard, src: tuple[slice, ...], out: torch.Tensor) -> Piece:
    st = file.stored(shard.key)
    first, count = region_span(st, src)
    return Piece(
        file, shard, src, out, st.start + first * st.dtype.itemsize, count * st.dtype.itemsize
    )


def split_runs(pieces: list[Piece], parts: int) -> list[list[Piece]]:
    """``pieces`` cut into at most ``parts`` consecutive runs of about equal bytes."""
    total = sum(p.span for p in pieces)
    runs: list[list[Piece]] = [[]]
    done = 0
    for p in pieces:
        if runs[-1] and len(runs) < parts and done >= total * len(runs) / parts:
            runs.append([])
        runs[-1].append(p)
        done += p.span
    return runs


def region_span(stored: StoredTensor, src: tuple[slice, ...]) -> tuple[int, int]:
    """``(first, count)``: the run of elements of ``stored`` from the region's first element to
    its last (the region is contiguous when ``count`` equals its number of elements)."""
    strides = stored.strides
    first = sum(s.start * st for s, st in zip(src, strides))
    last = sum((s.stop - 1) * st for s, st in zip(src, strides))
    return first, last - first + 1


def as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


class Staging:
    """One growing buffer reused for every staged read (pinned when the copies go to a GPU)."""

    def __init__(self) -> None:
        self._buf: dict[bool, torch.Tensor] = {}

    def get(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        """A uint8 CPU tensor of ``nbytes`` (contents undefined)."""
        buf = self._buf.get(pin)
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * buf.numel() if buf is not None else 0)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            self._buf[pin] = buf
        return buf[:nbytes]


class ShardFile:
    """An open safetensors file whose tensors are read by byte range."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        try:
            self._f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        except OSError as e:
            raise CheckpointError(f"cannot open {path}: {e}") from e
        try:
            size = os.fstat(self._f.fileno()).st_size
            head = self._read_exact(0, 8, "the header length")
            n = int.from_bytes(head, "little")
            if n > min(MAX_HEADER, size - 8):
                raise CheckpointError(
                    f"{path} is not a safetensors file or is truncated: its header claims {n} "
                    f"bytes but the file has {size}. Load another step (checkpoint.resume=PATH)."
                )
            self.tensors = parse_header(self._read_exact(8, n, "the header"), size, path)
        except BaseException:
            self._f.close()
            raise

    def close(self) -> None:
        self._f.close()

    def _pread(self, out: memoryview, offset: int) -> int:
        if hasattr(os, "preadv"):  # positional: no shared file position between threads
            return os.preadv(self._f.fileno(), [out], offset)
        with self._lock:
            self._f.seek(offset)
            return self._f.readinto(out)

    def stored(self, key: str) -> StoredTensor:
        if key not in self.tensors:
            raise CheckpointError(f"{self.path} has no tensor {key!r}; the checkpoint is damaged")
        return self.tensors[key]

    def _read_exact(self, offset: int, n: int, what: str) -> bytes:
        buf = bytearray(n)
        self.read_into(offset, memoryview(buf), what)
        return bytes(buf)

    def read_into(self, offset: int, out: memoryview, what: str) -> None:
        """Fill ``out`` with the file's bytes from ``offset``; a short file raises. Threads may
        read one file concurrently."""
        done = 0
        while done < len(out):
            n = self._pread(out[done:], offset + done)
            if not n:
                raise CheckpointError(
                    f"{self.path} is truncated: reading {what} needs bytes up to "
                    f"{offset + len(out)} but the file ends at {offset + done}. The checkpoint "
                    "is damaged; load another step (checkpoint.resume=PATH)."
                )
            done += n

    def read_region(
        self, key: str, src: tuple[slice, ...], out: torch.Tensor, staging: Staging
    ) -> None:
        """Copy region ``src`` (one slice per dim) of stored tensor ``key`` into ``out``
        (shaped like the region; any dtype, device and strides)."""
        st = self.stored(key)
        if not src:  # a 0-d tensor: its one element
            st, src, out = StoredTensor(st.dtype, (1,), st.start), (slice(0, 1),), out.reshape(1)
        numel = math.prod(s.stop - s.start for s in src)
        if numel == 0:
            return
        first, count = region_span(st, src)
        direct = (
            count == numel
            and out.device.type == "cpu"
            and out.dtype == st.dtype
            and out.is_contiguous()
        )
        if direct:
            self.read_into(st.start + first * st.dtype.itemsize, as_bytes(out), key)
        else:
            self._staged(key, st, src, out, staging)

    def read_whole(self, key: str, staging: Staging) -> torch.Tensor:
        """Stored tensor ``key``, read into ``staging`` (valid until its next use)."""
        st = self.stored(key)
        buf = staging.get(math.prod(st.shape) * st.dtype.itemsize)
        self.read_into(st.start, as_bytes(buf), key)
        return buf.view(st.dtype).view(st.shape)

    def _staged(
        self,
        key: str,
        st: StoredTensor,
        src: tuple[slice, ...],
        out: torch.Tensor,
        staging: Staging,
    ) -> None:
        """Read slabs of rows (along the region's first dim longer than 1) into ``staging`` and
        copy each slab's strided view into ``out``."""
        lengths = [s.stop - s.start for s in src]
        k = next((d for d, n in enumerate(lengths) if n > 1), 0)
        strides, item = st.strides, st.dtype.itemsize
        rows = max(1, STAGING_SLAB // (strides[k] * item))
        pin = out.device.type == "cuda" and torch.cuda.is_available()
        for r0 in range(0, lengths[k], rows):
            part = list(src)
            part[k] = slice(src[k].start + r0, min(src[k].start + r0 + rows, src[k].stop))
            first, count = region_span(st, tuple(part))
            buf = staging.get(count * item, pin)
            self.read_into(st.start + first * item, as_bytes(buf), key)
            size = [p.stop - p.start for p in part]
            slab = buf.view(st.dtype).as_strided(size, strides)
            out.narrow(k, r0, size[k]).copy_(slab)
