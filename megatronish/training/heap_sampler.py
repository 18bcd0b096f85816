"""The peak of the bytes a CPU process has allocated, sampled: the CPU's ``max_memory_allocated``.

A process's resident set (RSS) is a poor measure of what training holds on a CPU: it counts the
interpreter and libraries, and glibc keeps freed buffers resident once its mmap threshold has grown
past them (ZeRO 3 frees and re-gathers each unit every step, so its RSS keeps what ZeRO 2 never
frees). glibc's ``mallinfo2`` says how many bytes are handed out right now, which is where every
CPU tensor's storage comes from; a daemon thread samples it and keeps the most, only on the rank
that prints it.

A ``mallinfo2`` call is not free: it walks every free chunk of every arena holding that arena's
lock, so a training thread that allocates meanwhile waits. It takes about 4 us on a compact heap
but ms on a fragmented one (1.8 ms with ~20k free chunks, 16.5 ms with ~70k). So the sampler
times every call and waits 100 times the last call's duration before the next one (at least
2 ms, at most 2 s): its calls hold the heap at most 1% of the time (for calls up to 20 ms; a
slower one, or one the scheduler stretched, is still followed by a 2 s pause only, so an
outlier blinds it for no longer than that). On a compact heap it samples every 2 ms, and its
wake-ups cost about 3-5% of a core (measured on our 2-core machines): hence one rank only.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections.abc import Callable


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
        )
    ]


def _load_mallinfo2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _load_mallinfo2()


def heap_in_use() -> int | None:
    """Bytes malloc has handed out now (its arenas' used chunks plus its mmapped ones); None
    without glibc's ``mallinfo2``."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


MIN_INTERVAL_S = 0.002
MAX_INTERVAL_S = 2.0
DUTY = 0.01  # the most of the time the sampler's calls may hold the heap


def next_interval(cost_s: float, lo: float = MIN_INTERVAL_S, hi: float = MAX_INTERVAL_S) -> float:
    """The wait after a call that took ``cost_s``: ``cost_s / DUTY`` within ``[lo, hi]``."""
    return min(hi, max(lo, cost_s / DUTY))


class HeapPeakSampler:
    """Samples ``read`` (:func:`heap_in_use`) on a daemon thread until :meth:`close`, waiting
    :func:`next_interval` of the last call's duration between calls; :meth:`take` returns the
    most seen since the previous take (or since the start).

    ``clock``, ``sleep`` and ``start=False`` (no thread: drive :meth:`sample` or :meth:`_run`
    by hand) are for tests."""

    def __init__(
        self,
        interval_s: float = MIN_INTERVAL_S,
        max_interval_s: float = MAX_INTERVAL_S,
        read: Callable[[], int | None] = heap_in_use,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], object] | None = None,
        start: bool = True,
    ):
        self.min_interval_s, self.max_interval_s = interval_s, max_interval_s
        self.interval_s = interval_s  # the wait before the next call
        self._read, self._clock, self._sleep = read, clock, sleep or self._pause
        # Held across a sample's read and merge, and by take(): a sample belongs to exactly one
        # window, and no window reports a value read in the one before it.
        self._lock = threading.Lock()
        self._peak = read()
        if self._peak is None:
            raise RuntimeError("sampling the heap needs glibc's mallinfo2")
        self._stop = threading.Event()
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._run, name="heap-peak", daemon=True)
            self._thread.start()

    def _pause(self, seconds: float) -> None:
        if seconds <= 0.01:
            time.sleep(seconds)  # cheaper than Event.wait(timeout) at the usual 2 ms
        else:
            self._stop.wait(seconds)  # a long back-off must not hold up close()

    def _run(self) -> None:
        while True:
            self._sleep(self.interval_s)
            if self._stop.is_set():  # closed during the wait: no read after close()
                return
            self.sample()

    def sample(self) -> None:
        """Read the heap once, keep the most, and set the wait before the next read."""
        with self._lock:
            t0 = self._clock()
            now = self._read()
            cost = self._clock() - t0
            self._peak = max(self._peak, now)
        self.interval_s = next_interval(cost, self.min_interval_s, self.max_interval_s)

    def take(self) -> int:
        """The peak since the previous call; the next peak starts from the bytes in use now."""
        with self._lock:
            now = self._read()
            peak, self._peak = max(self._peak, now), now
        return peak

    def close(self) -> None:
        """Stop sampling."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
