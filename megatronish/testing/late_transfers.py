"""An optimizer-offload copy layer whose copies complete late (tests).

Copies to the host run only when the host waits for them, copies to the device only when the
device waits for their event (or a later one), and each destination holds nan until its copy
has run; a copy reads its source when it runs, and raises if the source changed since it was
queued (a write racing the copy on a GPU). So on CPU a missing wait shows as nan, and a source
written while its copy is in flight as an error, as they would on a GPU whose copies run on
side streams (:mod:`megatronish.data_parallel.offload`).
"""

from __future__ import annotations

import torch

NAN = float("nan")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone()


def _copy(src: torch.Tensor, dst: torch.Tensor, queued: torch.Tensor, way: str) -> None:
    if not torch.equal(_bits(src), queued):
        raise AssertionError(f"the source of a copy {way} was written while the copy was queued")
    dst.copy_(src)


class LateTransfers:
    """:class:`~megatronish.data_parallel.offload.Transfers` whose copies complete late."""

    def __init__(self):
        # (src, dst, src's bits when queued)
        self.down: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # not yet run
        self.up: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.up_done = 0  # copies of ``up`` that ran
        self.copies = {"down": 0, "up": 0}

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.fill_(NAN)
        self.down.append((src, dst, _bits(src)))

    def host_waits(self) -> None:
        for src, dst, queued in self.down:
            _copy(src, dst, queued, "down")
        self.copies["down"] += len(self.down)
        self.down = []

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> int:
        dst.fill_(NAN)
        self.up.append((src, dst, _bits(src)))
        return len(self.up)

    def device_waits(self, event: int) -> None:
        for src, dst, queued in self.up[self.up_done : event]:
            _copy(src, dst, queued, "up")
        self.copies["up"] += max(0, event - self.up_done)
        self.up_done = max(self.up_done, event)
