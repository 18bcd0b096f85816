"""Activation memory: bytes of tensors saved for backward, and the Korthikanti et al. formula.

Measured by ``torch.autograd.graph.saved_tensors_hooks`` during one microbatch's forward:
every tensor autograd saves is counted once per underlying storage (views of one buffer count
once, with the whole buffer), excluding parameters and constant tables. Bytes are attributed to
the transformer block whose forward was running, so per-layer numbers need no formula.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn


class SavedBytes:
    """Counts saved-for-backward bytes per region while active (see module docstring)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.seen = {t.untyped_storage().data_ptr() for t in exclude}
        self.by_region: dict[str, int] = {}
        self.region = "outside blocks"

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self.seen:
            self.seen.add(ptr)
            self.by_region[self.region] = self.by_region.get(self.region, 0) + storage.nbytes()
        return t

    @contextlib.contextmanager
    def active(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield self

    def watch(self, blocks: dict[str, nn.Module]) -> list:
        """Attribute saves inside each of ``blocks`` to its name; returns the hook handles."""
        handles = []
        for name, block in blocks.items():

            def enter(_m, _args, name=name):
                self.region = name

            def leave(_m, _args, _out):
                self.region = "outside blocks"

            handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
        return handles


def measure_forward(
    forward: Callable[[], torch.Tensor], blocks: dict[str, nn.Module], exclude: list[torch.Tensor]
) -> dict[str, int]:
    """Saved bytes per block name (and ``outside blocks``) of one ``forward()`` (+ backward)."""
    counter = SavedBytes(exclude)
    handles = counter.watch(blocks)
    try:
        with counter.active():
            loss = forward()
    finally:
        for h in handles:
            h.remove()
    loss.backward()  # frees the saved tensors (and checks they were a real graph)
    return counter.by_region


def korthikanti_16bit(s: int, b: int, h: int, a: int, t: int, sp: bool) -> float:
    """Bytes per layer, as published (16-bit activations, 1-byte dropout masks, GeLU MLP 4h).

    Without sp: ``sbh (10 + 24/t) + 5 a s^2 b / t``; with sp: ``sbh (34/t) + 5 a s^2 b / t``.
    """
    linear = (34 / t) if sp else (10 + 24 / t)
    return s * b * h * linear + 5 * a * s * s * b / t


def korthikanti_fp32_no_dropout(
    s: int, b: int, h: int, a: int, t: int, sp: bool, attention_matrix: bool = True
) -> float:
    """The same terms for fp32 activations without dropout (see ``ADAPTATION``)."""
    linear = (64 / t) if sp else (16 + 48 / t)
    return s * b * h * linear + (4 * a * s * s * b / t if attention_matrix else 0.0)


ADAPTATION = (
    "The published per-layer terms in 16-bit units are: replicated 10sbh = 4 (two norm inputs) "
    "+ 2 (qkv input) + 2 (MLP input) + 2 (two 1-byte dropout masks of sbh); sharded 24sbh/t = "
    "4 (Q, K) + 2 (V) + 2 (projection input) + 8 (GeLU input) + 8 (GeLU output); attention "
    "5as^2b/t = 2 (softmax) + 1 (dropout mask) + 2 (dropout output). For fp32 without dropout we "
    "drop both dropout masks and the dropout output (the softmax itself then feeds the "
    "V product) and double the rest: without sp sbh(16 + 48/t) + 4as^2b/t, with sp sbh(64/t) + "
    "4as^2b/t. SDPA's fused (flash) CPU kernel stores no s x s matrix, only the output and a "
    "logsumexp, so the column without the attention term is the one to compare with. The "
    "formula assumes a GeLU MLP with ffn = 4h and a = kv heads; this llama has SwiGLU with ffn "
    "= 2.75h (gate|up, 5.5h, plus the SiLU product, 2.75h), 2 kv heads for 4 query heads, and "
    "RoPE, which saves rotated copies of Q and K."
)
