"""The interleaved repeats of the checkpoint benchmark.

Each repeat runs the write variants (raw write, blocking save, async save with training steps
during its writer), then the read variants (raw read, ``load_into`` with its reading threads and
with one, ``load_into`` checking every shard's CRC32, plain safetensors ``load_file``), each
cold (pages evicted first) and warm (files read once, untimed, first), one zlib CRC32 pass over
the same bytes in memory, then megatronish's snapshot and the proposed persistent-buffer copy at
2 and 1 threads. The order of the variants is reversed on every other repeat. Reads use the files
written in the same repeat; everything written is removed at the end of the repeat, outside the
timings.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from ckpt_disk import (
    crc_pass,
    dir_bytes,
    dir_files,
    evict,
    host_buffer,
    payload,
    raw_read,
    raw_write,
)
from ckpt_measure import (
    CkptRig,
    PersistentCopy,
    async_round,
    remove,
    timed_load,
    timed_load_file,
    timed_save,
    timed_snapshot,
)
from common import threads

WRITES = ("raw write", "save", "async save")
READS = ("raw read", "load", "load 1 reader", "load verified", "load_file")
COPIES = ("snapshot", "piecewise copy", "persistent copy")  # each at 2 and 1 intra-op threads


def warm_up(rig: CkptRig) -> int:
    """One untimed save and load (first-call costs); returns the bytes of a step directory."""
    _, path = timed_save(rig)
    nbytes = dir_bytes(path)
    timed_load(rig, path)
    remove(path)
    return nbytes


def _prime(files: list[str], buf: memoryview) -> None:
    for f in files:
        raw_read(f, buf)


def _read_round(
    rig: CkptRig, raw_path: str, ckpt: str, buf: memoryview, flip: bool
) -> dict[str, float]:
    """Seconds of each read variant, cold and warm, in one repeat."""
    raw_files, ckpt_files = [raw_path], dir_files(ckpt)
    dest = torch.frombuffer(buf, dtype=torch.uint8)
    ops: dict[str, tuple[list[str], Callable[[], float]]] = {
        "raw read": (raw_files, lambda: raw_read(raw_path, buf)),
        "load": (ckpt_files, lambda: timed_load(rig, ckpt)),
        "load 1 reader": (ckpt_files, lambda: timed_load(rig, ckpt, threads=1)),
        "load verified": (ckpt_files, lambda: timed_load(rig, ckpt, verify=True)),
        "load_file": (ckpt_files, lambda: timed_load_file(ckpt_files, dest)),
    }
    out: dict[str, float] = {}
    for cache in ("cold", "warm") if not flip else ("warm", "cold"):
        for name in READS if not flip else reversed(READS):
            files, op = ops[name]
            evict(files) if cache == "cold" else _prime(files, buf)
            out[f"{name} {cache}"] = op()
    return out


def _copy_round(rig: CkptRig, persistent: PersistentCopy, flip: bool) -> dict[str, float]:
    """Seconds of the snapshot and of the persistent-buffer copies at 2 and 1 threads."""
    ops = {
        "snapshot": lambda: timed_snapshot(rig),
        "piecewise copy": lambda: persistent.timed(piecewise=True),
        "persistent copy": persistent.timed,
    }
    out: dict[str, float] = {}
    for n in (2, 1) if not flip else (1, 2):
        with threads(n):
            for name in COPIES if not flip else reversed(COPIES):
                out[f"{name} {n}t"] = ops[name]()
    return out


def rounds(rig: CkptRig, nbytes: int, repeats: int, baseline_steps: int) -> dict:
    """Every repeat's timings: ``{variant: [seconds per repeat]}`` plus the async details."""
    data, buf = payload(), host_buffer(nbytes + (1 << 20))
    persistent = PersistentCopy(rig)
    raw_path = os.path.join(rig.dir, "raw.bin")
    times: dict[str, list[float]] = {}
    saved_bytes: list[int] = []
    asyncs: list[dict] = []
    for r in range(repeats):
        flip = r % 2 == 1
        ckpt = None
        for name in WRITES if not flip else reversed(WRITES):
            if name == "raw write":
                seconds = raw_write(raw_path, nbytes, data)
            elif name == "save":
                seconds, ckpt = timed_save(rig)
                saved_bytes.append(dir_bytes(ckpt))
            else:
                result = async_round(rig, baseline_steps)
                remove(result.pop("path"))
                asyncs.append(result)
                seconds = result["snapshot_s"] + result["publish_s"]
            times.setdefault(name, []).append(seconds)
        measured = _read_round(rig, raw_path, ckpt, buf, flip)
        measured["crc32"] = crc_pass(buf[:nbytes])
        measured.update(_copy_round(rig, persistent, flip))
        for name, seconds in measured.items():
            times.setdefault(name, []).append(seconds)
        remove(ckpt)
        os.remove(raw_path)
    copies = {"piecewise copy": len(persistent.pieces), "persistent copy": len(persistent.pairs)}
    return {"times": times, "saved_bytes": saved_bytes, "async": asyncs, "copies": copies}
