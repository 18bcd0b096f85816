"""Point-to-point transfers between pipeline stages, with shapes known from the config.

Receives from each peer are posted in exactly the order that peer sends (from the pure
schedule's :func:`message_order`), so matching holds for backends that pair messages by order
(NCCL) as well as by tag. Sends are asynchronous; their buffers are released once complete.
"""

from __future__ import annotations

import torch

from megatronish.distributed.comm import ParallelGroup, irecv, isend

Message = tuple[str, int, int]  # ("act" | "grad", microbatch, chunk)


class Inbox:
    """Receives activations and grads of a fixed shape, in each sender's order."""

    def __init__(
        self,
        group: ParallelGroup,
        order: dict[tuple[int, int], list[Message]],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.group, self.shape, self.dtype, self.device = group, shape, dtype, device
        me = group.rank
        self.expected = {src: msgs for (src, dst), msgs in order.items() if dst == me}
        self.next_index = dict.fromkeys(self.expected, 0)
        self.posted: dict[Message, tuple[torch.Tensor, object]] = {}

    def _post_through(self, src: int, message: Message) -> None:
        msgs = self.expected[src]
        while message not in self.posted:
            i = self.next_index[src]
            if i >= len(msgs):
                raise RuntimeError(f"message {message} from pipeline rank {src} is not scheduled")
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.posted[msgs[i]] = (buf, irecv(buf, self.group, src))
            self.next_index[src] = i + 1

    def get(self, src: int, message: Message) -> torch.Tensor:
        """Block until ``message`` from pipeline rank ``src`` has arrived and return it."""
        self._post_through(src, message)
        buf, work = self.posted.pop(message)
        work.wait()
        return buf


class Outbox:
    """Asynchronous sends; a sent tensor is kept alive until its transfer completes."""

    def __init__(self, group: ParallelGroup):
        self.group = group
        self.pending: list[tuple[object, torch.Tensor]] = []

    def send(self, t: torch.Tensor, dst: int) -> None:
        t = t.contiguous()
        self.pending.append((isend(t, self.group, dst), t))
        self.pending = [(w, b) for w, b in self.pending if not w.is_completed()]

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
