"""Count the bytes ops move: every aten op's tensor inputs read once and its outputs written once.

A model of a GPU's memory traffic for element-wise work (what a quantization costs next to the
GEMM it feeds): each op run eagerly is one kernel that reads every tensor it is given and writes
every tensor it returns, in full (``numel * itemsize``; a broadcast operand counts at its
broadcast size, an in-place op its tensor twice). Views move nothing and are not counted; a
factory like ``new_zeros`` or ``empty_like`` reads only its input's metadata, so only its output
counts.
Unlike :class:`~megatronish.testing.allocations.AllocatedBytes` (new storages) this counts reads
and in-place writes too.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from megatronish.testing.allocations import OpBytes


def _bytes(tree) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)
    )


class MovedBytes(OpBytes):
    """``with MovedBytes() as moved: ...``; then ``moved.total`` bytes and ``moved.by_op`` (op
    name -> bytes), over every aten op that is not a view."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        name = str(func.overloadpacket.__name__)
        read = 0 if name.startswith("new_") or name.endswith("_like") else _bytes((args, kwargs))
        self.by_op[name] += read + _bytes(out)
        return out
