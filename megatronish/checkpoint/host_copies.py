"""Device->host copies of a checkpoint snapshot that run beside training.

A :class:`HostCopies` queues copies of device tensors into host tensors and says, through
events, when they have completed. For asynchronous saves on a GPU (:class:`StreamCopies`) each
copy is queued with ``non_blocking=True`` on a side CUDA stream into a pinned host buffer that
the next snapshot reuses under the same key, so the host never waits for a copy; its user orders
the side stream after the training stream (:meth:`~HostCopies.follow_training`), records an
event after its copies (:meth:`~HostCopies.record`), has the thread that reads the host tensors
wait for that event (``event.synchronize()``, off the training thread), and makes the training
stream wait for it, on the device, before work that overwrites a copied tensor
(:meth:`~HostCopies.training_waits`). On CPU, and for every save of a run without
``checkpoint.async_save`` (:class:`ImmediateCopies`), a copy completes as it is queued, into new
pageable host memory that the save drops when written, and every event is complete: the
blocking copies saves always made.

Pinned memory is page-locked host memory the operating system cannot swap or reclaim. torch's
caching pinned-memory allocator rounds every request up to a power of two and keeps freed
blocks cached; :class:`StreamCopies` keeps one buffer per written tensor piece for the life of
the process, so an async-saving rank holds between 12 and 24 bytes of pinned memory per
parameter it writes (``docs/operations.md``).

Tests inject a layer whose copies complete only once an event covering them is waited for, and
whose destinations hold nan until then (``tests/checkpoint/test_async_save_streams.py``): a
missing wait shows on CPU as it would on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class CopyEvent(Protocol):
    """Completes once the copies queued before it was recorded have completed."""

    def synchronize(self) -> None:
        """Block the calling thread until the event has completed."""

    def query(self) -> bool:
        """Whether the event has completed (never blocks)."""


class HostCopies(Protocol):
    """A queue of device->host copies that runs beside the training stream."""

    def follow_training(self) -> None:
        """Order the copies queued from now on after the training stream's work queued so far
        (the values they copy)."""

    def to_host(self, src: torch.Tensor, key: str) -> torch.Tensor:
        """Queue a copy of ``src``; returns the contiguous host tensor that holds ``src``'s
        values once an event recorded after this call has completed. A layer may reuse the
        tensor under ``key`` in a later snapshot: only after the earlier one was read."""

    def record(self) -> CopyEvent:
        """An event that completes once every copy queued so far has completed."""

    def training_waits(self, event: CopyEvent) -> None:
        """Order the training stream's work queued from now on after ``event``, without
        blocking the host."""

    def release(self, tensors: list[torch.Tensor]) -> None:
        """Hand back device tensors that copies read: their reader saw the copies complete, or
        the training stream waits for them before any work queued from now on. Their memory
        may be reused at once (the caller drops its references)."""


class CompletedEvent:
    """The event of copies that completed as they were queued."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class ImmediateCopies:
    """Blocking copies into new host memory (CPU training, where "device" memory is host memory
    and a copy is done when it returns)."""

    def follow_training(self) -> None:
        return None

    def to_host(self, src: torch.Tensor, key: str) -> torch.Tensor:
        return src.detach().to("cpu", copy=True).contiguous()

    def record(self) -> CopyEvent:
        return CompletedEvent()

    def training_waits(self, event: CopyEvent) -> None:
        return None

    def release(self, tensors: list[torch.Tensor]) -> None:
        return None


class StreamCopies:
    """Copies on a side CUDA stream into pinned host buffers reused across snapshots (async
    saves on a GPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pinned: dict[str, torch.Tensor] = {}  # key -> host buffer of the last snapshot

    def follow_training(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def to_host(self, src: torch.Tensor, key: str) -> torch.Tensor:
        dst = self.pinned.get(key)
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
            dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self.pinned[key] = dst
        with torch.cuda.stream(self.stream):
            dst.copy_(src.detach(), non_blocking=True)
        return dst

    def record(self) -> CopyEvent:
        # blocking: a host thread's synchronize() sleeps instead of spinning a core
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return event

    def training_waits(self, event: CopyEvent) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def release(self, tensors: list[torch.Tensor]) -> None:
        # Dropping the caller's references returns the memory to the caching allocator, whose
        # next user (on the training stream) is queued after copies the host saw complete.
        return None


def host_copies_for(device: torch.device, async_save: bool) -> HostCopies:
    """The copy layer for the saves of a run with tensors on ``device``: a side stream into
    pinned buffers kept for reuse when ``async_save`` on CUDA, else blocking copies into new
    pageable host memory (no pinned memory is ever taken for a run that saves blocking)."""
    return StreamCopies(device) if async_save and device.type == "cuda" else ImmediateCopies()


@dataclass
class PendingCopies:
    """One snapshot's queued copies, as the thread that reads its host tensors sees them."""

    copies: HostCopies
    event: CopyEvent  # recorded after the snapshot's last copy
    device_buffers: list[torch.Tensor] = field(default_factory=list)  # read by the copies

    def wait(self) -> None:
        """Block until the copies have completed, then hand back the device buffers they read.
        Call it from the thread that reads the host tensors, never the training thread."""
        self.event.synchronize()
        buffers, self.device_buffers = self.device_buffers, []
        self.copies.release(buffers)
