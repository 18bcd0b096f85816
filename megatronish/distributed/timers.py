"""Where the time of a training step goes: named wall-clock timers, summed per log window.

The step code wraps each phase in ``timers.region(key)`` (or ``start`` / ``stop``). ``cheap``
timers read ``time.perf_counter`` and nothing else, so on a GPU they measure host time: a region
that launches kernels looks short and the time shows up where the host next blocks.
``detailed`` timers synchronise the device before and after each region, so GPU work is charged
to the region that launched it (at the price of losing the overlap the sync removes).

While a profile is recording (``ranges`` is set), a region with a label also opens a
``torch.profiler`` range of that name; labels are formatted only then, so building them costs
nothing otherwise.

At a log step every rank calls :func:`max_min_over_ranks` (one all-reduce), so the logged
values are the slowest and the fastest rank's seconds per step for each timer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import torch

TIMER_NAMES = (
    "data",  # building this rank's microbatches of the step
    "forward",  # model forward calls (all microbatches and chunks)
    "backward",  # backward calls (they also launch the asynchronous grad reductions)
    "pp_recv_wait",  # pipeline receives: waiting for activations / grads from a neighbour
    "pp_send_wait",  # pipeline sends: posting them and waiting for them to complete
    "grad_reduce_wait",  # ZeRO finish_reduction: late reductions and waiting for async ones
    "param_gather",  # waiting for ZeRO parameter all-gathers (zero 3 per block; zero 1/2 after
    # the update or, overlapped, per block in the next forward)
    "optimizer",  # global grad norm, clipping and the AdamW update
    "checkpoint",  # checkpoint save and poll in the training loop
)
TIMER_MODES = ("off", "cheap", "detailed")
_NOTHING = contextlib.nullcontext()  # what a region is when it neither times nor records


class _Region:
    """One timed region (and profiler range); a context manager entered once."""

    __slots__ = ("timers", "key", "label", "args", "start", "range")

    def __init__(self, timers: Timers, key: str | None, label: str | None, args: tuple):
        self.timers, self.key, self.label, self.args = timers, key, label, args
        self.range = None

    def __enter__(self) -> _Region:
        t = self.timers
        if t.ranges and self.label is not None:
            name = self.label.format(*self.args) if self.args else self.label
            self.range = torch.profiler.record_function(name)
            self.range.__enter__()
        if self.key is not None and t.active:
            if t.sync is not None:
                t.sync()
            self.start = time.perf_counter()
        else:
            self.start = None
        return self

    def __exit__(self, *exc: object) -> None:
        t = self.timers
        if self.start is not None:
            if t.sync is not None:
                t.sync()
            t.totals[self.key] += time.perf_counter() - self.start
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None


class Timers:
    """Per-window totals of named timers (seconds), with a no-op mode.

    ``mode``: ``cheap`` (perf_counter only), ``detailed`` (``sync`` called around each region)
    or ``off`` (regions time nothing; profiler ranges still work). ``sync`` is the device
    synchronisation of ``detailed`` mode (see :func:`device_sync`).
    """

    def __init__(
        self,
        mode: str = "cheap",
        sync: Callable[[], None] | None = None,
        names: Sequence[str] = TIMER_NAMES,
    ):
        if mode not in TIMER_MODES:
            raise ValueError(f"timer mode {mode!r} is not one of {', '.join(TIMER_MODES)}")
        self.mode = mode
        self.names = tuple(names)
        self.sync = sync if mode == "detailed" else None
        self.active = mode != "off"
        self.ranges = False  # set while a torch.profiler trace is recording
        self.totals = dict.fromkeys(self.names, 0.0)
        self.steps = 0
        self._open: dict[str, _Region] = {}

    @classmethod
    def off(cls) -> Timers:
        """Timers that time nothing (the default where no timers are passed)."""
        return cls("off")

    def region(self, key: str | None, label: str | None = None, *args: object):
        """Time ``key`` (None: only a profiler range) over a ``with`` block.

        ``label.format(*args)`` names the profiler range; it is formatted only while profiling.
        """
        if not self.ranges and (key is None or not self.active):
            return _NOTHING
        return _Region(self, key, label, args)

    def start(self, key: str, label: str | None = None, *args: object) -> None:
        """Start ``key`` (like entering ``region``); a running ``key`` is stopped first."""
        self.stop(key)
        region = self.region(key, label, *args)
        region.__enter__()
        self._open[key] = region

    def stop(self, key: str) -> None:
        """Stop ``key``; does nothing if it was not started."""
        region = self._open.pop(key, None)
        if region is not None:
            region.__exit__(None, None, None)

    def end_step(self) -> None:
        """Count a finished step of the current window."""
        self.steps += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time nothing inside (e.g. evaluation between training steps)."""
        was = self.active
        self.active = False
        try:
            yield
        finally:
            self.active = was

    def per_step(self) -> dict[str, float]:
        """Seconds per step of each timer over the window (totals when no step ended)."""
        steps = max(self.steps, 1)
        return {k: v / steps for k, v in self.totals.items()}

    def reset(self) -> None:
        """Start a new window."""
        self.totals = dict.fromkeys(self.names, 0.0)
        self.steps = 0


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """What ``detailed`` timers call around regions: a CUDA sync, or None (CPU ops are eager)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


def max_min_over_ranks(
    values: dict[str, float],
    reduce_max: Callable[[torch.Tensor], object],
    device: torch.device | str = "cpu",
) -> dict[str, tuple[float, float]]:
    """``{key: (max, min)}`` over ranks with a single max-reduction of ``[v, -v]``.

    ``reduce_max`` reduces a float64 vector in place with MAX over the ranks (an all-reduce; the
    identity for one rank). Every rank must call it on the same steps with the same keys.
    """
    keys = list(values)
    vec = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    both = torch.cat([vec, -vec])
    reduce_max(both)
    out = both.tolist()
    n = len(keys)
    return {k: (out[i], -out[n + i]) for i, k in enumerate(keys)}


def timer_metrics(max_min: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Log keys: ``time/<name>_max_ms`` and ``time/<name>_min_ms`` per step."""
    out = {}
    for k, (hi, lo) in max_min.items():
        out[f"time/{k}_max_ms"] = hi * 1e3
        out[f"time/{k}_min_ms"] = lo * 1e3
    return out
