"""Agreement between ranks: every rank fails together, with the first failing rank's reason."""

from __future__ import annotations

import torch

from megatronish.distributed.comm import ParallelGroup, all_reduce

_MAX_MESSAGE = 4096


class PeerError(RuntimeError):
    """Raised on every rank when some rank reported a failure."""


def agree(error: str | None, group: ParallelGroup) -> None:
    """Collective: raise :class:`PeerError` on every rank if any rank passes an ``error``.

    The lowest failing rank's message is shared so every rank's log says what went wrong.
    """
    if group.size == 1:
        if error is not None:
            raise PeerError(error)
        return
    failed = torch.tensor([group.rank if error is not None else group.size], dtype=torch.int64)
    all_reduce(failed, group, op="min")
    src = int(failed.item())
    if src == group.size:
        return
    buf = torch.zeros(_MAX_MESSAGE, dtype=torch.uint8)
    if group.rank == src:
        data = error.encode()[:_MAX_MESSAGE]
        buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    all_reduce(buf, group, op="max")  # only the source wrote non-zeros
    text = bytes(buf[buf != 0].tolist()).decode(errors="replace")
    raise PeerError(f"rank {group.global_rank(src)}: {text}")
