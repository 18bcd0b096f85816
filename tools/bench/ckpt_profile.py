"""Where a checkpoint save or load spends its time: cProfile rows with their main caller.

``save(blocking=True)`` writes in a background thread, which cProfile (main thread only) would
not see, so the save is profiled as its three parts called in the main thread: ``snapshot``,
``write_rank_files`` and ``merge_and_publish`` (exactly what the saver runs).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time
from collections.abc import Callable

from ckpt_disk import dir_files, evict
from ckpt_measure import CkptRig

from megatronish.checkpoint.load import load_into
from megatronish.checkpoint.save import merge_and_publish, snapshot, write_rank_files

Key = tuple[str, int, str]


def where(key: Key) -> str:
    """``file.py:line(function)`` with the directory dropped (builtins as cProfile names them)."""
    file, line, func = key
    if file == "~":
        return func
    return f"{os.path.basename(file)}:{line}({func})"


def top_rows(stats: pstats.Stats, total: float, n: int = 8) -> list[dict]:
    """The ``n`` entries with the most own time, each with the caller that spent most of it."""
    entries = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    rows = []
    for key, (_, calls, own, cum, callers) in entries:
        caller = max(callers.items(), key=lambda kv: kv[1][2])[0] if callers else None
        rows.append({
            "where": where(key), "caller": where(caller) if caller else "",
            "calls": calls, "own_s": own, "cum_s": cum, "share": own / total,
        })  # fmt: skip
    return rows


def profiled(fn: Callable[[], object]) -> tuple[float, list[dict]]:
    """Wall seconds of ``fn()`` under cProfile and its top rows."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - t0
    return wall, top_rows(pstats.Stats(prof), wall)


def profile_save(rig: CkptRig) -> tuple[float, list[dict], dict[str, float], str]:
    """Profile one save's parts in the main thread; also each part's wall seconds and the
    published step directory (for the caller to remove)."""
    trainer, saver = rig.run.trainer, rig.saver
    step = trainer.state.step
    tmp = os.path.join(rig.dir, f".tmp_profile_{step:07d}")
    os.makedirs(tmp)
    parts: dict[str, float] = {}
    published: list[str] = []

    def save() -> None:
        t0 = time.perf_counter()
        tensors, index = snapshot(trainer, None)
        t1 = time.perf_counter()
        write_rank_files(tmp, 0, tensors, index)
        t2 = time.perf_counter()
        final = merge_and_publish(rig.dir, tmp, step, 1, saver._header(), 0)
        t3 = time.perf_counter()
        parts.update(snapshot=t1 - t0, write=t2 - t1, publish=t3 - t2)
        published.append(final)

    wall, rows = profiled(save)
    return wall, rows, parts, published[0]


def profile_load(rig: CkptRig, path: str) -> tuple[float, list[dict]]:
    """Profile one cold ``load_into`` of ``path`` into the fresh trainer, without checksums and
    with one reading thread (cProfile sees only the main thread)."""
    evict(dir_files(path))
    rig.fresh.trainer.cfg.checkpoint.verify = False
    return profiled(lambda: load_into(rig.fresh.trainer, path, threads=1))
