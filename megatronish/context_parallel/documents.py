"""Packed documents: where a microbatch's documents start and end, as one cp rank sees it.

A packed ``seq_length + 1`` window holds the end of one document, whole documents and the start
of another. With ``data.reset_attention_mask`` a token attends only to earlier tokens of its own
document, with ``data.reset_position_ids`` its position counts from its document's first token,
and with ``data.eod_mask_loss`` the tokens whose target starts the next document are left out
of the loss (Megatron-LM's ``--reset-attention-mask``, ``--reset-position-ids``,
``--eod-mask-loss``). :mod:`megatronish.data.documents` builds a :class:`Documents` per
microbatch on the host; the model reads it in every layer, and what is derived from it (masks,
RoPE tables) is built once per microbatch, at its first use, and kept here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch


@dataclass(eq=False)  # identity: tensors have no plain equality
class Documents:
    """One microbatch's document layout; every field is None when its option is off.

    ``ids``: ``[b, s]`` the document index of every token of the whole sequence (the keys'
    documents; this cp rank's queries are its chunks of it). ``positions``: ``[b, s/cp]`` each
    local token's position in its document. ``loss_weights``: ``[b, s/cp]`` fp32, 1 where the
    token's loss counts, 0 where its target starts the next document. ``loss_divisor``: what the
    microbatch's summed loss is divided by, so that the mean over the global batch is over its
    kept tokens (see :func:`megatronish.data.documents.loss_divisor`). ``segments``: per
    sample, its inputs as runs of whole documents ``(start, end, several documents)`` (host
    integers; :func:`megatronish.data.documents.attention_segments`).
    """

    ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    loss_weights: torch.Tensor | None = None
    loss_divisor: float | None = None
    segments: tuple[tuple[tuple[int, int, bool], ...], ...] | None = None
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = ("ids", "positions", "loss_weights")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Documents:
        """A copy on ``device`` (nothing derived is carried over)."""
        moved = {n: t.to(device, non_blocking=non_blocking) for n, t in self._tensors().items()}
        return replace(self, **moved, _derived={})

    def pin_memory(self) -> Documents:
        """A copy in pinned host memory (for non-blocking copies to a GPU)."""
        return replace(self, **{n: t.pin_memory() for n, t in self._tensors().items()})

    def derived(self, key: tuple, build: Callable[[], object]) -> object:
        """``build()`` the first time ``key`` is asked for, the same object afterwards: every
        layer and every recompute of this microbatch shares it."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]
