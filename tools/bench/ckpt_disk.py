"""Raw disk references for the checkpoint benchmark: sequential write, read, cache eviction.

The raw write is what any checkpoint writer is bounded by: one file of the same size, large
buffered writes, then ``fsync``. The raw read reads a file into a preallocated buffer of its
size (what a loader must at least do). Cold reads evict the file's pages from the page cache
with ``posix_fadvise(DONTNEED)`` first, which needs no root and leaves other processes' cached
files alone (the files are fsynced, so their pages are clean and really dropped).
"""

from __future__ import annotations

import os
import time
import zlib

import torch

CHUNK = 16 << 20  # bytes per write / read call


def dir_files(path: str) -> list[str]:
    """The regular files directly under ``path``."""
    names = sorted(os.listdir(path))
    return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]


def dir_bytes(path: str) -> int:
    """Total size of the files directly under ``path``."""
    return sum(os.path.getsize(f) for f in dir_files(path))


def evict(paths: list[str]) -> None:
    """Drop the page-cache pages of ``paths`` (flushed first, so they are clean)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def payload(nbytes: int = CHUNK) -> memoryview:
    """Bytes to write: random fp32 values (incompressible, like trained weights)."""
    return memoryview(torch.randn(nbytes // 4).numpy()).cast("B")


def raw_write(path: str, nbytes: int, data: memoryview) -> float:
    """Seconds to write ``nbytes`` to a new file at ``path`` in ``CHUNK`` writes, then fsync."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(data))
            f.write(data[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def host_buffer(nbytes: int) -> memoryview:
    """A touched (already faulted-in) buffer of ``nbytes`` to read into."""
    return memoryview(torch.ones(nbytes, dtype=torch.uint8).numpy()).cast("B")


def crc_pass(data: memoryview) -> float:
    """Seconds of one zlib CRC32 over ``data`` in memory (what a checksummed load adds)."""
    t0 = time.perf_counter()
    zlib.crc32(data)
    return time.perf_counter() - t0


def raw_read(path: str, out: memoryview) -> float:
    """Seconds to read the file at ``path`` into ``out`` (at least its size) in ``CHUNK`` reads."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while n := f.readinto(out[pos : pos + CHUNK]):
            pos += n
    return time.perf_counter() - t0
