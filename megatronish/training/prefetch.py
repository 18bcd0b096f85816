"""The next step's batches, read and stacked on a background thread while this step computes.

A step's batches are a pure function of the data and the global sample cursor, so reading them
early changes nothing in the sample stream: the prefetcher only moves the work off the step. On
a GPU the host tensors are pinned, so the training thread's copies to the device are
asynchronous (``non_blocking``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

HostBatches = list[tuple]  # per microbatch: (inputs, targets) or (inputs, targets, Documents)


class BatchPrefetcher:
    """``get(first)`` returns ``read(first)``, the prefetched result when ``first`` was
    predicted, then starts reading ``first + stride`` in the background (unless ``more`` is
    False: the run ends with this step)."""

    def __init__(self, read: Callable[[int], HostBatches], stride: int, enabled: bool = True):
        self.read, self.stride, self.enabled = read, stride, enabled
        self._pool: ThreadPoolExecutor | None = None  # started by the first prefetch
        self._next: tuple[int, Future] | None = None

    def get(self, first: int, more: bool = True) -> HostBatches:
        if self._next is not None and self._next[0] == first:
            batches = self._next[1].result()  # re-raises the reader's error here
        else:
            self._drop()
            batches = self.read(first)
        self._next = None
        if self.enabled and more:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="megatronish-data")
            self._next = (first + self.stride, self._pool.submit(self.read, first + self.stride))
        return batches

    def _drop(self) -> None:
        if self._next is not None:
            self._next[1].cancel()
            self._next = None

    def close(self) -> None:
        """Stop prefetching and end the thread (a read in flight finishes, its result is
        dropped); a later :meth:`get` starts a new one."""
        self._drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
