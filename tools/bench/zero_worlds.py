"""Persistent forked worlds that time training steps on command, so worlds can be interleaved.

``common.interleaved`` alternates variants inside one process or one world. Data-parallel
scaling compares worlds of different sizes (1 rank vs 2 ranks), which cannot share a world, so
this module keeps several worlds alive at once: each rank builds its variants, then blocks on a
command queue (a pipe read: no CPU while the other world runs). The parent sends
``(variant, steps)`` to every rank of one world, the ranks run the steps behind a barrier and
report their seconds per step; a world's time is its slowest rank's.

On a shared machine the wall time alone can mislead (Linux autogroup scheduling gives each
session an equal share of the cores, however many ranks it runs), so every rank also reports,
per step, its process CPU time (all threads) and how its main thread spent the wall time
(``/proc/thread-self/schedstat``): on a CPU, runnable but waiting for a CPU, or blocked (in a
collective, waiting for the other rank).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatronish.testing.multiproc import run_world

# builder(rank, world) -> {variant name: step function returning the loss}
Builder = Callable[[int, int], dict[str, Callable[[], float]]]


def _schedstat() -> tuple[float, float]:
    """Seconds this thread spent on a CPU and waiting for one (zeros where unavailable)."""
    with contextlib.suppress(OSError, ValueError):
        on_cpu, waiting, _ = Path("/proc/thread-self/schedstat").read_text().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    return 0.0, 0.0


def _serve(rank: int, world: int, builder: Builder, commands, results) -> dict:
    """One rank: build the variants, then run timed blocks until told to stop."""
    steppers = builder(rank, world)
    losses: dict[str, list[float]] = {name: [] for name in steppers}
    results.put(("ready", rank, None))
    while (command := commands[rank].get()) is not None:
        name, steps = command
        if world > 1:
            dist.barrier()
        t0, cpu0, (on0, wait0) = time.perf_counter(), time.process_time(), _schedstat()
        for _ in range(steps):
            losses[name].append(steppers[name]())
        wall, cpu, (on1, wait1) = time.perf_counter() - t0, time.process_time() - cpu0, _schedstat()
        on, waiting = on1 - on0, wait1 - wait0
        per_step = {"wall": wall, "process_cpu": cpu, "on_cpu": on, "cpu_wait": waiting,
                    "blocked": wall - on - waiting}  # fmt: skip
        results.put((name, rank, {k: v / steps for k, v in per_step.items()}))
    if world > 1:
        dist.barrier()  # ranks leave together (a rank exiting early can hang gloo shutdown)
    return {"losses": losses}


class World:
    """A forked gloo world of ``size`` ranks serving timed steps of ``builder``'s variants."""

    def __init__(self, size: int, builder: Builder, timeout: float = 1800.0):
        ctx = mp.get_context("fork")
        self.size = size
        self.commands = [ctx.SimpleQueue() for _ in range(size)]
        self.results = ctx.SimpleQueue()
        self.outcome: list[Any] | BaseException | None = None

        def target() -> None:
            try:
                self.outcome = run_world(
                    _serve, size, builder, self.commands, self.results,
                    timeout=timeout, collective_timeout=600,
                )  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - reported by close()
                self.outcome = exc
                self.results.put(("failed", -1, None))

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()
        self._collect("ready")

    def _collect(self, expected: str) -> list[Any]:
        values: list[Any] = [None] * self.size
        for _ in range(self.size):
            name, rank, value = self.results.get()
            if name == "failed":
                raise RuntimeError(f"world failed: {self.outcome}")
            if name != expected:
                raise RuntimeError(f"expected {expected!r} from the world, got {name!r}")
            values[rank] = value
        return values

    def time(self, name: str, steps: int) -> list[dict[str, float]]:
        """Run ``steps`` steps of variant ``name``; each rank's measures per step (seconds):
        ``wall``, ``process_cpu``, and the main thread's ``on_cpu``, ``cpu_wait``, ``blocked``."""
        for q in self.commands:
            q.put((name, steps))
        return self._collect(name)

    def close(self) -> list[dict]:
        """Stop the ranks; returns each rank's ``{"losses": {variant: [...]}}``."""
        for q in self.commands:
            q.put(None)
        self.thread.join()
        if isinstance(self.outcome, BaseException):
            raise RuntimeError("world failed") from self.outcome
        return self.outcome


def step_time(ranks: list[dict[str, float]]) -> float:
    """A world's seconds per step: its slowest rank's."""
    return max(r["wall"] for r in ranks)


def interleaved_worlds(
    variants: dict[str, tuple[World, int]], repeats: int, warmup: int = 2
) -> dict[str, list[list[dict[str, float]]]]:
    """Every variant's per-rank measures (see ``World.time``), one entry per repeat.

    Like ``common.interleaved``: ``variants`` maps a name to its world and steps per repeat;
    every variant first runs ``warmup`` untimed steps; odd repeats run the variants in reverse
    order.
    """
    for name, (world, _) in variants.items():
        if warmup:
            world.time(name, warmup)
    names = list(variants)
    times: dict[str, list[list[dict[str, float]]]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            world, steps = variants[name]
            times[name].append(world.time(name, steps))
    return times
