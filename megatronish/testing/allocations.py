"""Count the bytes that ops allocate: every new storage an op returns while the mode is active.

Unlike the allocator's peak (see :mod:`megatronish.testing.memory`) this is the traffic: a
zero tensor that is made, summed into another and freed counts in full, however briefly it
lived. Views and in-place or ``out=`` results (storages an op was given) do not count. It sees
every op autograd runs in a backward started inside it (CPU backward runs on the calling thread).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storages(tree) -> dict[int, int]:
    out = {}
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


class OpBytes(TorchDispatchMode):
    """A dispatch mode that adds bytes per op name into ``by_op``; ``total`` sums them."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here compiles; wrapping for dynamo would import it (~1 s)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


class AllocatedBytes(OpBytes):
    """``with AllocatedBytes() as counted: ...``; then ``counted.total`` bytes, ``counted.by_op``
    (op name -> bytes)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = _storages((args, kwargs))
        for ptr, nbytes in _storages(out).items():
            if ptr not in given:
                self.by_op[str(func.overloadpacket.__name__)] += nbytes
        return out
