"""Count the host-device synchronisations code would force on a GPU, while it runs on a CPU.

On CUDA the host waits for the device whenever Python needs a value the device computes, and a
GPU runs ahead of Python only while the host never waits. On CPU nothing waits, so the same code
looks free. :class:`HostSyncRecorder` records, for a region of code, every operation that makes
the host wait on CUDA, each with a short stack of where it happened:

- a device tensor read on the host: ``.item()``, ``int()``, ``float()``, ``bool()`` (an ``if``
  on a tensor), ``__index__``, ``.tolist()``, ``.cpu()``, ``.numpy()``, formatting it;
- an op whose output size depends on the values, so the host reads a count first:
  ``nonzero``, ``bincount``, ``unique*``, ``masked_select``, boolean indexing (read or write),
  ``repeat_interleave`` without ``output_size``, ``torch.equal``;
- a copy from pageable host memory to the device, synchronous on CUDA: ``torch.tensor`` /
  ``torch.as_tensor`` / ``Tensor.new_tensor`` of Python data with an explicit device (the
  training device), ``.to(device)`` or ``.copy_`` of a host tensor without ``non_blocking``
  (and, the other way, ``.copy_`` into a host tensor, ``.to("cpu")`` / ``.to("cpu",
  copy=True)`` of a device tensor);
- an aten op whose inputs mix a host tensor of one or more dimensions with a device tensor
  (kind ``host tensor in aten::...``): ``D[host_index]`` and ``D.index_select(0, host_index)``
  copy the index to the device first, blocking; ``D + host_tensor`` raises on CUDA. A 0-dim
  host tensor is a scalar CUDA accepts without a copy; ``copy_`` follows the rule above.

Which tensors are on the host: one made inside the region by a factory (``torch.tensor``,
``torch.zeros``, ...) without a device argument, a copy to the host, and every tensor computed
only from host tensors; reading those is free (a gloo agreement). Every other tensor, made
before the region or with a device argument, counts as on the device, so on CPU the recorder
holds code to what a GPU would do (:meth:`HostSyncRecorder.mark` declares more host tensors,
e.g. host buffers made before the region). On CPU the training device is the CPU too, so a
``.to`` target is read by how it is written: the string ``"cpu"`` names the host, a
``torch.device`` (``topo.device``, ``t.device``) names the training device.

How it sees them: a ``TorchDispatchMode`` sees aten ops, forward and backward; a
``TorchFunctionMode`` sees Python-level calls (``tolist``, ``cpu`` and ``torch.tensor`` run no
aten op at all on CPU). Autograd runs backward code (hooks, custom Functions, recomputed
forwards) without torch-function modes when ``Tensor.backward`` started it, so while recording
``Tensor.tolist`` / ``cpu`` / ``numpy`` / ``new_tensor`` / ``to`` and ``torch.tensor`` /
``as_tensor`` are also wrapped; a wrapper counts only where the function mode is not active.
Only the thread that entered the recorder is recorded. Leaving the region (also by an
exception) removes the modes and the wrappers.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections import Counter
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

Tensor = torch.Tensor
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../megatronish
_ROOT = os.path.dirname(_PACKAGE)
_THIS = os.path.abspath(__file__)

# Python-level reads of a tensor's values (the first argument).
_READS = {
    getattr(Tensor, name): name
    for name in (
        "item",
        "tolist",
        "numpy",
        "cpu",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__complex__",
        "__array__",
        "__format__",
        "__repr__",
    )
}
# Factories: without a device argument they make a host tensor.
_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.from_numpy,
}
_FROM_DATA = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor"}
_MOVES = {Tensor.to, Tensor.cuda}
# aten ops that read a value on the host before they can size their output.
_SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::bincount",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
    "aten::masked_select",
    "aten::equal",
}
_BOOL_INDEXED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


@dataclass(frozen=True)
class HostSync:
    """One operation that makes the host wait for the device on CUDA."""

    kind: str  # e.g. "item", "tolist", "aten::bincount", "torch.tensor(data, device=...)"
    where: str  # innermost project frames first: "moe/dispatch.py:84 dispatch < ..."

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}"


def _ours(filename: str) -> bool:
    return filename.startswith(_ROOT) and filename != _THIS and "site-packages" not in filename


def _where(depth: int = 4) -> str:
    """The innermost ``depth`` frames of the project's code, innermost first."""
    frames = [f for f in traceback.extract_stack() if _ours(f.filename)]
    parts = [
        f"{os.path.relpath(f.filename, _PACKAGE if f.filename.startswith(_PACKAGE) else _ROOT)}"
        f":{f.lineno} {f.name}"
        for f in reversed(frames[-depth:])
    ]
    return " < ".join(parts) or "(outside the project)"


def _tensors(*trees) -> list[Tensor]:
    return [t for t in tree_leaves(trees) if isinstance(t, Tensor)]


def _device_arg(args: tuple, kwargs: dict):
    """The device a ``.to`` / ``.cuda`` call names (None: none)."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            return a
        if isinstance(a, Tensor):
            return a.device
    return None


class HostSyncRecorder:
    """Context manager: ``syncs`` lists every host-device synchronisation of the region.

    ``device`` is the training device: ``torch.tensor(data, device=device)`` counts (on CPU any
    explicit device does, as the CPU stands in for the GPU).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.syncs: list[HostSync] = []
        self._host = WeakTensorKeyDictionary()  # tensors that live on the host
        self._quiet = 0  # > 0 while a counted call runs: its inner aten ops are not counted again
        self._thread = threading.get_ident()
        self._modes = (_FunctionSide(self), _DispatchSide(self))
        self._patched: list[tuple[object, str, object]] = []

    # -- results ------------------------------------------------------------------------------
    def count(self, kind: str | None = None) -> int:
        """Syncs recorded (of one ``kind``, or all)."""
        return sum(kind is None or s.kind == kind for s in self.syncs)

    def report(self) -> str:
        """One line per distinct sync, most frequent first (for assertion messages)."""
        lines = [f"{n}x {s}" for s, n in Counter(self.syncs).most_common()]
        return f"{len(self.syncs)} host sync(s)" + "".join(f"\n  {line}" for line in lines)

    # -- the region ---------------------------------------------------------------------------
    def __enter__(self) -> HostSyncRecorder:
        self._thread = threading.get_ident()
        self._patch()
        entered = []
        try:
            for mode in self._modes:
                mode.__enter__()
                entered.append(mode)
        except BaseException:
            self._leave(entered)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._leave(self._modes)

    def _leave(self, modes) -> None:
        """Exit ``modes`` and remove the wrappers, whatever fails on the way."""
        try:
            for mode in reversed(modes):
                mode.__exit__(None, None, None)
        finally:
            for owner, name, original in reversed(self._patched):
                if original is None:  # inherited: drop the wrapper
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
            self._patched.clear()

    # -- rules --------------------------------------------------------------------------------
    def on_device(self, t) -> bool:
        return isinstance(t, Tensor) and t not in self._host

    def mark(self, outputs, host: bool) -> None:
        for t in _tensors(outputs):
            if host:
                self._host[t] = True
            else:
                self._host.pop(t, None)

    def add(self, kind: str) -> None:
        if not self._quiet:
            self.syncs.append(HostSync(kind, _where()))

    def is_training_device(self, device) -> bool:
        d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        return d.type != "cpu" or d.type == self.device.type

    def python_call(self, func, args: tuple, kwargs: dict):
        """The rules for Python-level calls (from the function mode or a wrapper)."""
        if func in _READS:
            if self.on_device(args[0]):
                self.add(_READS[func])
            return self._quietly(func, args, kwargs)
        if func in _FROM_DATA or func is Tensor.new_tensor:
            return self._from_data(func, args, kwargs)
        if func in _MOVES:
            return self._move(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _FACTORIES and kwargs.get("device") is None:
            self.mark(out, host=True)
        return out

    def _move(self, func, args: tuple, kwargs: dict):
        """``.to(device)`` / ``.cuda()``: a host tensor to the device waits unless
        ``non_blocking``; so does a device tensor to the host (``.to("cpu")``, also with
        ``copy=True``; on CPU only the string ``"cpu"`` names the host, see the module's
        docstring)."""
        source, blocking = args[0], not kwargs.get("non_blocking", False)
        named = "cuda" if func is Tensor.cuda else _device_arg(args, kwargs)
        out = self._quietly(func, args, kwargs)
        if named is None:  # a dtype change: where the source lives
            self.mark(out, host=source in self._host)
            return out
        target = torch.device("cuda", named) if isinstance(named, int) else torch.device(named)
        to_host = target.type == "cpu" and (source.device.type != "cpu" or isinstance(named, str))
        if to_host:
            if blocking and self.on_device(source):
                self.add(f".{func.__name__}(cpu)")
            if out is source and self.on_device(source):  # CPU: no copy; a GPU's is a new tensor
                out = self._quietly(Tensor.view_as, (source, source), {})
            self.mark(out, host=True)
        elif self.is_training_device(target):
            if blocking and not self.on_device(source):
                self.add(f"host tensor .{func.__name__}(device)")
            self.mark(out, host=False)
        return out

    def _quietly(self, func, args, kwargs):
        self._quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._quiet -= 1

    def _from_data(self, func, args: tuple, kwargs: dict):
        data = args[1] if func is Tensor.new_tensor else (args[0] if args else kwargs.get("data"))
        device = kwargs.get("device")
        if device is None and func is torch.as_tensor and len(args) > 2:
            device = args[2]
        if device is None and func is Tensor.new_tensor:
            device = None if args[0] in self._host else args[0].device
        out = self._quietly(func, args, kwargs)
        if isinstance(data, Tensor):  # a copy or a move of a tensor
            self.mark(out, host=device is None and data in self._host)
        elif device is not None and self.is_training_device(device):
            self.add(f"{_FROM_DATA.get(func, 'Tensor.new_tensor')}(data, device=...)")
            self.mark(out, host=False)
        else:
            self.mark(out, host=True)
        return out

    def aten_op(self, func, args: tuple, kwargs: dict, out) -> None:
        """The rules for an aten op that ran (from the dispatch mode)."""
        inputs = _tensors(args, kwargs)
        name = func._schema.name
        if inputs and any(self.on_device(t) for t in inputs):
            sync = name in _SYNC_OPS
            sync |= name == "aten::repeat_interleave" and kwargs.get("output_size") is None
            sync |= name in _BOOL_INDEXED and any(
                t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1])
            )
            if name == "aten::copy_":
                if self.on_device(args[0]) != self.on_device(args[1]):
                    sync = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            elif not sync and any(t in self._host and t.dim() > 0 for t in inputs):
                self.add(f"host tensor in {name}")  # copied to the device first, or an error
            if sync:
                self.add(name)
        if name == "aten::copy_":  # the destination stays where it lives
            return
        if inputs:  # outputs live where all inputs live (mixed: on the device)
            self.mark(out, host=all(t in self._host for t in inputs))

    # -- backward: no torch-function mode there -------------------------------------------------
    def _patch(self) -> None:
        targets = [(Tensor, n) for n in ("tolist", "cpu", "numpy", "new_tensor", "to")]
        targets += [(torch, "tensor"), (torch, "as_tensor")]
        for owner, name in targets:
            func = getattr(owner, name)
            self._patched.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, self._wrapper(func))

    def _wrapper(self, func):
        recorder = self

        def wrapper(*args, **kwargs):
            if (
                threading.get_ident() != recorder._thread
                or torch._C._is_torch_function_mode_enabled()  # the function mode sees it
                or recorder._quiet
            ):
                return func(*args, **kwargs)
            return recorder.python_call(func, args, kwargs)

        return wrapper


class _FunctionSide(TorchFunctionMode):
    def __init__(self, recorder: HostSyncRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.recorder.python_call(func, args, kwargs or {})


class _DispatchSide(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing is compiled while recording: wrapping __torch_dispatch__ in dynamo's disable
        # would only import torch._dynamo (~800 modules, seconds) in every forked rank.
        return False

    def __init__(self, recorder: HostSyncRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.recorder.aten_op(func, args, kwargs, out)
        return out
