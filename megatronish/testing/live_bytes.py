"""The most bytes of storages that ops made and that were alive at once, as a device would hold.

A ``TorchDispatchMode`` sees each aten op (a custom op as one op), so what a kernel allocates
inside itself does not count: on CPU the reference kernels of ``torch._scaled_mm`` and of the
experts' grouped stand-in hold fp32 copies of their operands that cuBLASLt and CUTLASS do not.
A storage counts from the op that returned it until it is freed (checked at each op, so the
peak is exact at op granularity); storages that existed before the mode are not counted.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakLiveBytes(TorchDispatchMode):
    """``with PeakLiveBytes() as live: ...``; then ``live.peak`` and ``live.now`` bytes."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # data_ptr -> (ref, bytes)
        self.peak = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here compiles; wrapping for dynamo would import it (~1 s)

    @property
    def now(self) -> int:
        self._drop_freed()
        return sum(nbytes for _, nbytes in self.live.values())

    def _drop_freed(self) -> None:
        for ptr in [p for p, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        self._drop_freed()
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if st.nbytes() and ptr not in given and ptr not in self.live:
                self.live[ptr] = (StorageWeakRef(st), st.nbytes())
        self.peak = max(self.peak, self.now)
        return out
