"""A microbatch as the engines receive it: ``(inputs, targets)`` or, with packed documents,
``(inputs, targets, documents)``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatronish.context_parallel.documents import Documents

Microbatch = Sequence  # (inputs, targets[, documents])


def microbatch_parts(
    microbatch: Microbatch,
) -> tuple[torch.Tensor, torch.Tensor, Documents | None]:
    """``(inputs, targets, documents)``; documents None when the microbatch has none."""
    inputs, targets, *rest = microbatch
    return inputs, targets, rest[0] if rest else None


def run_chunk(
    chunk: torch.nn.Module,
    x: torch.Tensor,
    targets: torch.Tensor | None,
    documents: Documents | None,
) -> torch.Tensor:
    """``chunk(x, targets)``, with the microbatch's documents when it has them."""
    if documents is None:
        return chunk(x, targets)
    return chunk(x, targets, documents)
