"""``trainer.compile``: each transformer block's forward compiled with ``torch.compile``.

What is compiled is the block's ``forward`` (attention, MLP or MoE layer, norms, residual adds),
not the module call, so the module hooks around it stay eager: ZeRO 3's per-block gather and
release, and full recompute, which wraps whole blocks, see the same module as without compile.
Parameter names do not change (no ``_orig_mod.`` prefix), so checkpoints of compiled and eager
runs are the same files.

A block is first compiled whole (``fullgraph=True``: one graph forward, one backward). Where
dynamo cannot capture it whole, the block falls back to graphs between the pieces it cannot
trace, and says why once (one log line per reason): every collective (tensor, sequence, context
and expert parallel; :mod:`megatronish.distributed.comm`) runs eagerly between graphs, so with
tp, cp or ep > 1 a block is compiled in pieces. Nothing falls back to eager silently: a block
that dynamo stops compiling (its recompile limit) raises instead (``fail_on_recompile_limit_hit``).

``trainer.compile_backend``: ``inductor`` (generated kernels, the default) or ``aot_eager``
(the same captured forward and backward graphs run by eager kernels: no code generation, for
debugging a compiled run and for tests).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class CompiledForward:
    """``module.forward``, compiled whole where dynamo can capture it and otherwise in pieces
    (see the module docstring). Blocks of one structure share the outcome (``fallbacks``, by
    structure): dynamo's cache is per code object, so a block of a structure that fell back
    would otherwise run another's pieces under the whole-graph wrapper. ``log`` gets one line
    per new reason."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        backend: str,
        log: Callable[[str], None],
        fallbacks: dict[tuple, str],
    ):
        self.name, self.eager, self.backend = name, module.forward, backend
        self.log, self.fallbacks = log, fallbacks
        self.structure = tuple(type(m).__qualname__ for m in module.modules())
        self.whole = torch.compile(self.eager, backend=backend, fullgraph=True)
        self.pieces: Callable[..., Any] | None = None

    @property
    def fullgraph(self) -> bool:
        """True while the block runs as one captured graph."""
        return self.pieces is None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.pieces is None:
            reason = self.fallbacks.get(self.structure)
            if reason is None:
                try:
                    return self.whole(*args, **kwargs)
                except torch._dynamo.exc.Unsupported as e:  # raised by tracing, before any op
                    reason = graph_break_reason(e)
            self._fall_back(reason)
        return self.pieces(*args, **kwargs)

    def _fall_back(self, reason: str) -> None:
        self.pieces = torch.compile(self.eager, backend=self.backend)
        if reason not in self.fallbacks.values():
            self.log(f"{self.name} and blocks like it compiled in pieces: {reason}")
        self.fallbacks[self.structure] = reason


def graph_break_reason(error: Exception) -> str:
    """Dynamo's graph-break message in one line, without object addresses; a collective
    (:func:`~megatronish.distributed.comm.between_graphs`) by its name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines)
    collective = re.search(r"function `(\w+)` in file \S*torch/_compile\.py", text)
    if collective and "marked as skipped" in text:
        return f"the collective {collective.group(1)} runs eagerly between graphs"
    reason = lines[0]
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), None)
    if explanation:
        reason += " (" + explanation.removeprefix("Explanation:").strip() + ")"
    return re.sub(r" at 0x[0-9a-f]+", "", reason)


def compile_blocks(
    chunks: Iterable[nn.Module], backend: str, log: Callable[[str], None]
) -> list[CompiledForward]:
    """Compile the forward of every transformer block of ``chunks`` (``GPTChunk``) in place;
    returns the compiled forwards (their ``fullgraph`` says how each ran)."""
    # Past dynamo's cache limit per code object (8 entries) a frame would silently run eagerly;
    # blocks of one structure share an entry (parameters are graph inputs), so a limit hit is a
    # bug to report, not a slowdown to hide. A process-wide dynamo setting, set for compiled runs.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    compiled, fallbacks = [], {}
    for chunk in chunks:
        for index, block in chunk.layers.items():
            forward = CompiledForward(f"layers.{index}", block, backend, log, fallbacks)
            block.forward = forward  # an instance attribute: nn.Module.__call__ calls it
            compiled.append(forward)
    return compiled
