"""Shared helpers of the benchmarks: threads, interleaved timing, medians, machine facts.

Benchmarks are not tests: they compare variants side by side in one process (or one forked
world), interleaved (A, B, A, B, ...) with the order reversed on every other repeat so that a
slow phase of the shared machine hits every variant alike, and they report medians.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads, restoring the previous count after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over repeats of ``numerator[i] / denominator[i]``.

    Interleaved variants that ran back to back saw the same machine load, so the ratio within a
    repeat cancels most of a slow phase; its median is steadier than a ratio of medians.
    """
    return median([n / d for n, d in zip(numerator, denominator, strict=True)])


def interleaved(
    steps: dict[str, Callable[[], object]],
    repeats: int,
    steps_per_repeat: int,
    warmup: int = 2,
    sync: Callable[[], None] | None = None,
    *,
    budget_s: float | None = None,
    min_repeats: int = 3,
    agree: Callable[[bool], bool] | None = None,
) -> dict[str, list[float]]:
    """Seconds per step of each variant, one entry per repeat.

    Every variant first runs ``warmup`` untimed steps. Then each repeat times
    ``steps_per_repeat`` consecutive steps of every variant in turn; odd repeats run the variants
    in reverse order (A B, B A, A B, ...). ``sync`` (e.g. a barrier) runs before each timing.

    With ``budget_s``, no new repeat starts once the timed repeats took that long and at least
    ``min_repeats`` ran (a loaded machine then yields fewer repeats, not a longer run). In a
    multi-rank world ``agree`` must turn each rank's stop flag into one decision (e.g. an
    all-reduce MAX) so that every rank runs the same steps.
    """
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    for r in range(repeats):
        if budget_s is not None and r >= min_repeats:
            stop = time.perf_counter() - start > budget_s
            if agree(stop) if agree is not None else stop:
                break
        for name in names if r % 2 == 0 else reversed(names):
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            for _ in range(steps_per_repeat):
                steps[name]()
            times[name].append((time.perf_counter() - t0) / steps_per_repeat)
    return times


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or platform's best guess)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, object]:
    """What the numbers were measured on."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
