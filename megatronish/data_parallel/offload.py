"""Optimizer offload (``parallel.optimizer_offload``): the fp32 main params, the Adam moments and
the update of this rank's ZeRO shard live on the host (ZeRO-Offload, Megatron-LM's CPU
optimizer).

A step, per bucket: the reduced, scaled grad shard is copied device->host as soon as the step's
last reduction of the bucket is done (during the backward: the reducer finishes reductions in
order, as under ZeRO 2/3); before the update the host waits for those copies (the one host wait
offload adds), then torch's fused AdamW updates the host shards; the updated values (cast to the
model's dtype on the host) are copied host->device in forward order, and the device waits for a
bucket's copy only before its first use: ZeRO 1/2's all-gather of the updated params, ZeRO 3's
gather, ZeRO 0's next forward. So the copies overlap the backward and the next forward's
gathers, and the device holds no optimizer state: 12 bytes per owned parameter less under bf16
(main params and moments), 8 under fp32 (the moments; the host keeps its own fp32 master).

The copies go through a :class:`Transfers` layer: CUDA streams into pinned host memory on a GPU
(:class:`StreamTransfers`), immediate copies on CPU (:class:`ImmediateTransfers`, where device
memory is host memory), and in tests a layer whose copies complete only when waited for, with
nan in their destinations until then (``megatronish.testing.late_transfers``): a missing wait
shows on CPU as it would on a GPU.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megatronish.data_parallel.buckets import Bucket
from megatronish.data_parallel.pinned_memory import pinned_block_bytes


class TransferEvent(Protocol):
    """Completes once the copy it was returned for has completed."""


class Transfers(Protocol):
    """Device<->host copies beside the training stream."""

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` (device -> host) after the training stream's work so far."""

    def host_waits(self) -> None:
        """Block the host until every :meth:`to_host` copy queued so far has completed."""

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> TransferEvent:
        """Queue ``dst.copy_(src)`` (host -> device); the host must not write ``src`` before
        the device has waited for the returned event."""

    def device_waits(self, event: TransferEvent) -> None:
        """Order the training stream's work queued from now on after ``event`` (no host
        block)."""


class ImmediateTransfers:
    """Copies that complete as they are queued (CPU: the device is the host)."""

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src)

    def host_waits(self) -> None:
        return None

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> TransferEvent:
        dst.copy_(src)
        return None

    def device_waits(self, event: TransferEvent) -> None:
        return None


class StreamTransfers:
    """Copies on two side CUDA streams (one each way) between device memory and pinned host
    memory."""

    def __init__(self, device: torch.device):
        self.device = device
        self.down = torch.cuda.Stream(device)  # device -> host
        self.up = torch.cuda.Stream(device)  # host -> device
        self.last_down: torch.cuda.Event | None = None

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.down.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.down):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.down)
        self.last_down = torch.cuda.Event(blocking=True)
        self.last_down.record(self.down)

    def host_waits(self) -> None:
        if self.last_down is not None:
            self.last_down.synchronize()

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> TransferEvent:
        self.up.wait_stream(torch.cuda.current_stream(self.device))  # dst is no longer read
        with torch.cuda.stream(self.up):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.up)
        return event

    def device_waits(self, event: TransferEvent) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


def transfers_for(device: torch.device) -> Transfers:
    """The copy layer of a run on ``device``."""
    return StreamTransfers(device) if device.type == "cuda" else ImmediateTransfers()


def _host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host memory for a slab: pinned on a GPU (its copies run asynchronously)."""
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


def slab_dtypes(param_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The host slabs of offload, one per kind: fp32 main params, the fp32 grads copied down,
    and (params not in fp32) the staging copy in the params' dtype for the way up."""
    kinds = {"main": torch.float32, "grads": torch.float32}
    if param_dtype != torch.float32:
        kinds["staging"] = param_dtype
    return kinds


class OptimizerOffload:
    """The host side of each bucket's owned shard: fp32 main params, the grads copied down, and
    (when the model's params are not fp32) a staging copy in their dtype for the way up.

    Each kind is one slab sliced per bucket (:func:`slab_dtypes`): torch's pinned allocator
    rounds every block up to a power of two (:mod:`~megatronish.data_parallel.pinned_memory`),
    so the rounding is paid once per kind, the same sum the planner adds up."""

    def __init__(
        self,
        buckets: list[Bucket],
        owned: list[tuple[int, int]],
        param_dtype: torch.dtype,
        transfers: Transfers,
    ):
        self.transfers, self.param_dtype = transfers, param_dtype
        self.up_events: dict[int, TransferEvent] = {}
        sizes = [hi - lo for lo, hi in owned]
        self.pinned = any(b.device.type == "cuda" for b in buckets)
        kinds = slab_dtypes(param_dtype).items()
        self.slabs = {k: _host_empty(sum(sizes), t, self.pinned) for k, t in kinds}
        views = {k: slab.split(sizes) for k, slab in self.slabs.items()}
        self.main = {id(b): v for b, v in zip(buckets, views["main"])}
        self.grads = {id(b): v for b, v in zip(buckets, views["grads"])}
        self.staging = {id(b): v for b, v in zip(buckets, views.get("staging", ()))}
        for b in buckets:
            self.main[id(b)].copy_(b.main_shard)  # the values as initialised (or drawn)
            b.main_shard = self.main[id(b)]  # the optimizer's values: on the host from now on

    def grads_down(self, b: Bucket, grad: torch.Tensor) -> None:
        """Queue the copy of ``b``'s final grad shard to the host."""
        self.transfers.to_host(grad, self.grads[id(b)])

    def host_grad(self, b: Bucket) -> torch.Tensor:
        return self.grads[id(b)]

    def params_up(self, b: Bucket) -> None:
        """Queue the copy of ``b``'s updated main shard (in the model's dtype) to the device."""
        src = self.main[id(b)]
        if id(b) in self.staging:
            src = self.staging[id(b)]
            src.copy_(self.main[id(b)])  # the cast, on the host
        self.up_events[id(b)] = self.transfers.to_device(src, b.param_shard)

    def await_params(self, b: Bucket) -> None:
        """The device's next use of ``b``'s params waits for their copy up (if one is queued)."""
        if id(b) in self.up_events:
            self.transfers.device_waits(self.up_events.pop(id(b)))

    def host_bytes(self) -> int:
        """Host bytes the slabs take: pinned blocks as torch's allocator rounds them on a GPU,
        their own size in pageable memory (CPU)."""
        sizes = [t.numel() * t.element_size() for t in self.slabs.values()]
        return sum(pinned_block_bytes(n) if self.pinned else n for n in sizes)
