"""A checkpoint's snapshot: this rank's pieces copied to host memory without stalling training.

The device->host copies go through a :class:`~megatronish.checkpoint.host_copies.HostCopies`
(for async saves on a GPU: ``non_blocking`` copies on a side CUDA stream into pinned buffers
reused by the next snapshot); :func:`start_snapshot` queues them and returns, and the thread
that reads the host tensors (the save's writer) first waits for their event. The training
thread never waits for a copy. ZeRO's un-sharding gathers stay on the training thread (they are
collectives). What keeps the copies right on a GPU, where the side stream runs concurrently
with the training stream:

- They copy this step's values: before each bucket's copies the side stream waits for the
  training stream's work queued so far (the last optimizer update, the bucket's gathers).
- Nothing overwrites a source before it was copied. A copy reads either the optimizer's own
  tensors (ZeRO 0: main params and Adam moments) or a gather buffer of the snapshot (ZeRO 1-3).
  Only the optimizer's next update writes the former, and it first makes the training stream
  wait for the copies' event (``ShardedAdamW.before_next_update``), on the device.
- Under ZeRO 1-3 each bucket is gathered into three buffers of its own size (one per kind),
  held in a ring of ``GATHER_RING`` slots: before bucket ``i + GATHER_RING`` is gathered, the
  training stream waits (on the device) for the copies out of bucket ``i``, whose buffers are
  then handed back to the allocator, whose next user on the training stream is ordered after
  that wait. So the snapshot holds at most the buffers of two consecutive buckets, at most
  3 x 4 bytes x the elements of the two largest buckets (one big parameter, an embedding or an
  expert stack, is a bucket of its own), not ``GATHER_RING`` x 3 x the largest bucket.
- The last buckets' gather buffers outlive the copies: they stay referenced until the writer
  saw the copies complete, so the caching allocator cannot hand their memory to the next step's
  work while the side stream still reads it.
- Pinned buffers are reused only after their previous contents were written: a snapshot reuses
  the previous one's, and ``CheckpointSaver.save`` first waits for the pending save's writer.

What overlaps with what on a GPU. The host never waits: :func:`start_snapshot` only queues.
ZeRO 0: nothing on the training stream waits for the copies until the next optimizer update,
so the next step's forward and backward run beside all of them. ZeRO 1-3: the gathers and the
copies pipeline (bucket ``i``'s copies run beside the gather of bucket ``i + 1``), but the
training stream waits for the copies of every bucket but the last two before the snapshot's
last gathers, so the next step's forward and backward run beside the copies of the last two
buckets only; its optimizer update waits for every copy.

On CPU (:class:`~megatronish.checkpoint.host_copies.ImmediateCopies`, also a GPU run's saves
without ``checkpoint.async_save``) every copy is done when it is queued, so those saves copy and
write exactly as blocking saves always did.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatronish.checkpoint.format import BUFFER, COMPRESSION
from megatronish.checkpoint.host_copies import (
    CopyEvent,
    HostCopies,
    PendingCopies,
    host_copies_for,
)
from megatronish.checkpoint.parts import CheckpointParts
from megatronish.checkpoint.pieces import (
    copy_threads,
    full_local_values,
    param_rects,
    saved_name,
    writes,
)
from megatronish.data_parallel.compression import Compressor
from megatronish.data_parallel.zero import ZeroDataParallel
from megatronish.distributed.topology import Topology
from megatronish.optim.sharded_adamw import ShardedAdamW
from megatronish.tensor_parallel.sharding import global_shape

KINDS = ("model", "exp_avg", "exp_avg_sq")
GATHER_RING = 2  # ZeRO 1-3 buckets gathered at once: one gathers while another is copied out


@dataclass
class Snapshot:
    """This rank's host tensors to write, their index entries and the copies that fill them."""

    tensors: dict[str, dict[str, torch.Tensor]]
    index: list[dict]
    optimizer_steps: torch.Tensor  # the optimizer's update count, on the host
    copied: PendingCopies  # wait() before reading ``tensors`` or ``optimizer_steps``


def start_snapshot(parts: CheckpointParts, copies: HostCopies) -> Snapshot:
    """Queue the copies of this rank's tensors to write and return without waiting for them.

    Collective (ZeRO's gathers run here); reads no device value on the host. The run's
    next optimizer update waits for the copies on the device; whoever reads the host tensors
    first calls ``copied.wait()``.
    """
    tensors: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}, "rng": {}}
    index: list[dict] = []
    copies.follow_training()
    steps = copies.to_host(parts.optimizer.steps_on_device, "optimizer_steps")
    with copy_threads():
        buffers = _snapshot_buckets(parts.zero, parts.optimizer, parts.topo, copies, tensors, index)
    buffers += _snapshot_model_buffers(parts, copies, tensors, index)
    if parts.zero.compressor is not None:
        buffers += _snapshot_compression(parts.zero.compressor, copies, tensors)
    event = copies.record()
    parts.optimizer.before_next_update(functools.partial(copies.training_waits, event))
    if parts.rng is not None:
        tensors["rng"] = {k: v.clone() for k, v in parts.rng.state_dict().items()}
    return Snapshot(tensors, index, steps, PendingCopies(copies, event, buffers))


def snapshot(parts: CheckpointParts) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict]]:
    """This rank's tensors to write (complete host copies) and their index entries. Collective;
    blocks until the copies are done."""
    shot = start_snapshot(parts, host_copies_for(parts.topo.device, async_save=False))
    shot.copied.wait()
    return shot.tensors, shot.index


def _snapshot_model_buffers(
    parts: CheckpointParts,
    copies: HostCopies,
    tensors: dict[str, dict[str, torch.Tensor]],
    index: list[dict],
) -> list[torch.Tensor]:
    """Queue the copies of the model's buffers (``parts.buffers``), written by tp, cp and dp
    rank 0 of each stage (every rank holds the same values). Each is first cloned on the
    training stream, so the next step's in-place update cannot race the copy; returns the
    clones, kept until the copies are done."""
    coords = parts.topo.coords
    if (coords.tp, coords.cp, coords.dp) != (0, 0, 0):
        return []
    clones = []
    for name, buf in parts.buffers.items():
        clone = buf.detach().clone()
        key = f"{BUFFER}{name}@0"
        tensors["model"][key] = copies.to_host(clone, key)
        index.append(
            {
                "name": f"{BUFFER}{name}",
                "key": key,
                "offsets": [[0, n] for n in buf.shape],
                "shape": list(buf.shape),
                "dtype": str(buf.dtype).removeprefix("torch."),
                "file": "model",
            }
        )
        clones.append(clone)
    return clones


def _snapshot_compression(
    compressor: Compressor, copies: HostCopies, tensors: dict[str, dict[str, torch.Tensor]]
) -> list[torch.Tensor]:
    """Queue the copies of this rank's gradient-compression state (error feedback, PowerSGD's
    Q), layout-specific like the RNG streams: cloned on the training stream first (the next
    backward updates it in place), then copied out; returns the clones."""
    clones = {k: v.detach().clone() for k, v in compressor.state_dict().items()}
    tensors[COMPRESSION] = {k: copies.to_host(v, k) for k, v in clones.items()}
    return list(clones.values())


class GatherRing:
    """The flat gather buffers of the buckets being copied out (ZeRO 1-3): ``GATHER_RING``
    slots, each holding one bucket's three buffers (one per kind, of that bucket's size). A slot
    takes the next bucket only after the training stream waited for the copies out of the
    bucket it held, whose buffers are then handed back."""

    def __init__(self, copies: HostCopies, device: torch.device):
        self.copies, self.device = copies, device
        self.slots: list[list[torch.Tensor]] = [[] for _ in range(GATHER_RING)]
        self.copied_out: list[CopyEvent | None] = [None] * GATHER_RING  # after each's copies

    def take(self, i: int, numel: int) -> list[torch.Tensor]:
        """Bucket ``i``'s buffers, ``numel`` elements each."""
        slot = i % GATHER_RING
        if (event := self.copied_out[slot]) is not None:  # its memory goes to the gather
            self.copies.training_waits(event)
            self.copies.release(self.slots[slot])
            self.copied_out[slot] = None
        self.slots[slot] = []  # dropped before the new ones are allocated: they may reuse it
        self.slots[slot] = [torch.empty(numel, device=self.device) for _ in KINDS]
        return self.slots[slot]

    def copied(self, i: int) -> None:
        """Bucket ``i``'s copies are queued."""
        self.copied_out[i % GATHER_RING] = self.copies.record()

    def buffers(self) -> list[torch.Tensor]:
        return [buf for buffers in self.slots for buf in buffers]


def _snapshot_buckets(
    zero: ZeroDataParallel,
    optimizer: ShardedAdamW,
    topo: Topology,
    copies: HostCopies,
    tensors: dict[str, dict[str, torch.Tensor]],
    index: list[dict],
) -> list[torch.Tensor]:
    """Queue every piece's copy; returns the gather buffers the copies read (ZeRO 1-3)."""
    ring = None
    if zero.zero_stage.shards_optimizer_state and zero.buckets:
        ring = GatherRing(copies, zero.buckets[0].device)
    for i, bucket in enumerate(zero.buckets):
        into = None if ring is None else ring.take(i, bucket.numel)
        flats = full_local_values(zero, optimizer, i, bucket, into)
        copies.follow_training()
        for (name, p), offset in zip(bucket.params, bucket.offsets):
            if not writes(name, p, bucket, offset, topo.coords.tp):
                continue
            gname = saved_name(name, p)
            for r, rect in enumerate(param_rects(p, topo.coords.tp, topo.tp)):
                # a replicated head is saved by the rank holding its first copy
                if not rect.first_copy:
                    continue
                for kind, flat in zip(KINDS, flats):
                    local = flat[offset : offset + p.numel()].view(p.shape)
                    key = f"{kind}/{gname}@{r}"
                    piece = copies.to_host(rect.take(local), key)
                    tensors["model" if kind == "model" else "optim"][key] = piece
                    index.append(
                        {
                            "name": f"{kind}/{gname}",
                            "key": key,
                            "offsets": rect.offsets,
                            "shape": list(global_shape(p, topo.tp)),
                            "dtype": "float32",
                            "file": "model" if kind == "model" else "optim",
                        }
                    )
        if ring is not None:
            ring.copied(i)
    return [] if ring is None else ring.buffers()
