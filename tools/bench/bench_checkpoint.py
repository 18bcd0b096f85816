"""Checkpoint save / load throughput against the raw disk, and the cost of async saves.

One process holds a trained megatronish Trainer (a ~28M-parameter llama: 333 MB of fp32 params
and Adam moments) and a freshly built one of the same layout. In the same directory, interleaved
repeats time a raw sequential write of the same size (large writes + fsync) against
``CheckpointSaver.save(blocking=True)``, a raw sequential read against ``load_into`` (with and
without checksums, and plain safetensors ``load_file``) with the page cache cold and warm, and
``save(blocking=False)`` (the step-boundary stall) with training steps running during its
background writer. When save or load falls under half the raw disk, one save and one load are
profiled (``ckpt_profile.py``).

Run alone: ``.venv/bin/python tools/bench/bench_checkpoint.py [--quick] [--profile] [--dir D]``.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time

import torch
from ckpt_measure import MODEL_TEXT, build_rig, remove
from ckpt_notes import findings
from ckpt_profile import profile_load, profile_save
from ckpt_rounds import rounds, warm_up
from ckpt_tables import (
    TARGET,
    async_table,
    copies_table,
    interference_table,
    profile_table,
    summarize,
    throughput_table,
)
from common import machine_info
from sections import write_section

from megatronish.checkpoint.shard_reader import READ_THREADS

NAME = "checkpoint"
TITLE = "Checkpoint save / load throughput vs the raw disk, async save stall"


def filesystem(path: str) -> str:
    """``device fstype`` of the mount holding ``path`` (from /proc/mounts)."""
    best = ("", "?", "?")
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if path.startswith(mnt) and len(mnt) > len(best[0]):
                best = (mnt, dev, fstype)
    return f"{best[1]} ({best[2]})"


def profiles(rig, nbytes: int) -> dict:
    """One profiled save and one profiled cold load, in the main thread."""
    save_wall, save_rows, parts, path = profile_save(rig)
    load_wall, load_rows = profile_load(rig, path)
    remove(path)
    return {"save": {"wall_s": save_wall, "rows": save_rows, "parts_s": parts},
            "load": {"wall_s": load_wall, "rows": load_rows}, "bytes": nbytes}  # fmt: skip


def run(quick: bool = False, force_profile: bool = False, base: str | None = None) -> dict:
    """The section result (see ``sections.py``)."""
    t0 = time.perf_counter()
    repeats, baseline_steps = (3, 1) if quick else (5, 2)
    work = tempfile.mkdtemp(prefix="megatronish-ckpt-bench-", dir=base)
    try:
        rig = build_rig(work)
        nbytes = warm_up(rig)
        res = rounds(rig, nbytes, repeats, baseline_steps)
        s = summarize(res, nbytes)
        r = s["ratio"]
        below = min(r["save"], r["load cold"], r["load warm"]) < TARGET
        prof = profiles(rig, nbytes) if below or force_profile else None
        params = rig.params
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tables = [throughput_table(s), async_table(s), interference_table(s), copies_table(s)]
    if prof is not None:
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in prof["save"]["parts_s"].items())
        tables.append(profile_table(f"Where a save goes ({parts})", prof["save"]["wall_s"],
                                    prof["save"]["rows"]))  # fmt: skip
        tables.append(profile_table("Where a cold load_into goes", prof["load"]["wall_s"],
                                    prof["load"]["rows"]))  # fmt: skip
    method = (
        f"One process ({torch.get_num_threads()} threads), model: {MODEL_TEXT} "
        f"({params / 1e6:.1f}M params; a checkpoint is {nbytes / 1e6:.0f} MB: fp32 params + 2 Adam "
        f"moments, ZeRO 0, tp=pp=dp=1). In a fresh directory on {filesystem(work)}, {repeats} "
        "interleaved repeats (order reversed every other repeat), medians (in brackets: the best "
        "repeat, closest to an unloaded machine). Raw write: one file "
        "of the checkpoint's size in 16 MiB buffered writes + fsync; save: "
        "`CheckpointSaver.save(blocking=True)` (snapshot, safetensors + CRC32 + index, fsync, "
        "metadata, rename), GB/s = bytes of the step directory / seconds. Raw read: that file "
        "read into a preallocated buffer in 16 MiB `readinto`s (one thread); load: `load_into` "
        "of the step directory into a second, freshly built trainer of the same layout, "
        f"without checksums (`checkpoint.verify=false`) with its {READ_THREADS} reading threads "
        "and with one, and with every shard's CRC32 checked; reference: safetensors' "
        "`load_file` of the same files with every tensor copied once into a preallocated "
        "buffer. Cold = the files' "
        "pages evicted with posix_fadvise(DONTNEED) after fsync (the host's cache below the VM "
        "may still serve them); warm = read once, untimed, first. Async: `save(blocking=False)` "
        "plus the `poll()` that publishes, vs the blocking save in the same repeat; then "
        "`train_step`s run back to back until the writer thread ends, compared with "
        f"{baseline_steps} normal steps of the same repeat (a step counts as during the writer "
        "when at least half of it overlapped). Host memory: megatronish's `snapshot` vs one "
        "`copy_` per bucket and kind into buffers allocated and touched once, at 2 and 1 "
        "threads."
    )
    return {
        "name": NAME, "title": TITLE, "method": method, "quick": quick, "tables": tables,
        "notes": findings(s, prof),
        "raw": {"summary": s, "rounds": res, "profile": prof, "params": params,
                "directory": filesystem(work)},
        "seconds": time.perf_counter() - t0, "machine": machine_info(),
    }  # fmt: skip


def main() -> None:
    from report import render_section

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--profile", action="store_true", help="profile even when on target")
    parser.add_argument("--dir", default=None, help="parent of the scratch directory (tmp)")
    args = parser.parse_args()
    section = run(args.quick, args.profile, args.dir)
    print(render_section(section))
    print(f"wrote {write_section(section)}")


if __name__ == "__main__":
    main()
