"""Parameter units: the groups of parameters ZeRO gathers, uses and frees together.

A unit is the parameters of one transformer block, of the embedding or of the head (FSDP2's
``fully_shard`` per block). When the head reuses the word embedding of its own chunk (tied
embeddings without a pipeline), embedding and head form one unit: its weight is needed at both
ends of the forward and of the backward. Units are listed in forward order.

:func:`install_visit_hooks` connects a unit's modules to an owner (ZeRO's parameter gatherer):

- ``before_forward`` before each forward of one of its modules (recompute included);
- ``after_forward`` after it;
- ``before_backward`` when the gradient of a module's output arrives, i.e. just before
  autograd runs the module's backward.

Each is told the chunk's *visits* (the unit modules in forward order) and which one runs, so the
owner knows the next unit in forward order and the next one in backward order (for prefetch).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from megatronish.data_parallel.param_gather import ParamGatherer


@dataclass(eq=False)
class ParamUnit:
    """Parameters gathered as one; ``buckets`` hold them (ZeRO 3 aligns buckets to units)."""

    chunk: int
    index: int  # position in the chunk's forward order
    modules: list[nn.Module]  # in forward order
    named_params: list[tuple[str, nn.Parameter]]
    buckets: list = field(default_factory=list)
    gathered: bool = False
    works: list = field(default_factory=list)  # in-flight all-gathers of a prefetch
    grads_pending: int = 0  # params whose grad of the running backward has not arrived yet
    holds_loss: bool = False  # its modules include the head (the loss)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_params]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    def __repr__(self) -> str:
        return f"ParamUnit(chunk={self.chunk}, index={self.index}, params={len(self.named_params)})"


@dataclass(frozen=True)
class Visit:
    """One module of a unit, at its place in the chunk's forward order."""

    unit: ParamUnit
    module: nn.Module
    last: bool  # the unit's last module in forward order
    named_params: tuple[tuple[str, nn.Parameter], ...]  # the unit's params first seen here


def visit_names(chunk: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(unit name, module)`` in the chunk's forward order.

    A GPT chunk visits its embedding, each block and its head (embedding and head are one unit
    when tied within the chunk); any other module is a single unit.
    """
    layers = getattr(chunk, "layers", None)
    if layers is None:
        return [("chunk", chunk)]
    embedding, head = getattr(chunk, "embedding", None), getattr(chunk, "head", None)
    tied_here = embedding is not None and head is not None and head.embedding is not None
    out: list[tuple[str, nn.Module]] = []
    if embedding is not None:
        out.append(("embedding+head" if tied_here else "embedding", embedding))
    out += [(f"layers.{i}", block) for i, block in layers.items()]
    if head is not None:
        out.append(("embedding+head" if tied_here else "head", head))
    return out


def chunk_visits(chunk: nn.Module, chunk_index: int) -> tuple[list[ParamUnit], list[Visit]]:
    """The chunk's units (in order of first use) and its module visits in forward order; each
    parameter belongs to exactly one unit."""
    owner = {id(p): n for n, p in chunk.named_parameters()}
    named_visits = visit_names(chunk)
    by_name: dict[str, ParamUnit] = {}
    seen: set[int] = set()
    firsts: list[tuple[tuple[str, nn.Parameter], ...]] = []
    for name, module in named_visits:
        unit = by_name.get(name)
        if unit is None:
            unit = by_name[name] = ParamUnit(chunk_index, len(by_name), [], [])
        unit.modules.append(module)
        first = []
        for p in module.parameters():
            if id(p) in owner and id(p) not in seen:
                seen.add(id(p))
                first.append((owner[id(p)], p))
        unit.named_params += first
        firsts.append(tuple(first))
    missing = [n for n, p in chunk.named_parameters() if id(p) not in seen]
    if missing:
        raise ValueError(f"parameters outside every unit of chunk {chunk_index}: {missing}")
    head = getattr(chunk, "head", None)
    for unit in by_name.values():
        unit.holds_loss = head is not None and any(m is head for m in unit.modules)
    last_visit = {name: i for i, (name, _) in enumerate(named_visits)}
    visits = [
        Visit(by_name[name], module, last_visit[name] == i, firsts[i])
        for i, (name, module) in enumerate(named_visits)
    ]
    return list(by_name.values()), visits


def _tensors(output: torch.Tensor | tuple[object, ...] | list[object] | None) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


def install_visit_hooks(visits: list[Visit], owner: ParamGatherer, after: bool = True) -> list:
    """Register forward and backward hooks on every visited module; returns the handles.

    The owner is called with ``(visits, i)``: ``before_forward`` before the module's forward
    (recompute included) and, when ``after``, ``after_forward`` after it and
    ``before_backward`` when the gradient of its output arrives, just before autograd runs its
    backward. The hooks hold ``owner`` weakly: a dropped owner leaves harmless hooks behind.
    """
    ref = weakref.ref(owner)
    handles = []
    for i, visit in enumerate(visits):

        def pre(_module: nn.Module, _args: tuple[object, ...], i: int = i) -> None:
            if (o := ref()) is not None:
                o.before_forward(visits, i)

        def post(
            _module: nn.Module,
            _args: tuple[object, ...],
            output: torch.Tensor | tuple[object, ...] | list[object] | None,
            i: int = i,
        ) -> None:
            o = ref()
            if o is None:
                return
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(_backward_hook(ref, visits, i))
            o.after_forward(visits, i)

        handles.append(visit.module.register_forward_pre_hook(pre))
        if after:
            handles.append(visit.module.register_forward_hook(post))
    return handles


def _backward_hook(
    ref: weakref.ref[ParamGatherer], visits: list[Visit], i: int
) -> Callable[[torch.Tensor], None]:
    def hook(_grad: torch.Tensor) -> None:
        if (o := ref()) is not None:
            o.before_backward(visits, i)

    return hook
