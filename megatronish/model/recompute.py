"""Activation checkpointing policies (``trainer.recompute``).

- ``none``: keep every activation for backward.
- ``selective``: recompute the attention core (scaled dot-product attention and its dropout):
  the ``s x s`` score tensors are never kept (Korthikanti et al., 2022).
- ``full``: keep only the input of groups of layers and recompute them in backward.
  ``recompute_method=uniform`` checkpoints every consecutive group of ``recompute_num_layers``
  layers of a chunk; ``block`` checkpoints only the first ``recompute_num_layers`` layers of
  each chunk (one at a time) and keeps the rest.

Recompute replays the RNG states (torch's and the tensor-parallel tracker's) that the original
forward saw, so dropout masks, losses and gradients are bit-identical to running without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from torch.utils.checkpoint import checkpoint

from megatronish.tensor_parallel.random import RNGTracker

if TYPE_CHECKING:
    from megatronish.model.gpt import GPTChunk


def checkpointed(fn: Callable, *args: object, rng: RNGTracker):
    """``fn(*args)`` whose activations are recomputed in backward with the same RNG draws."""
    snapshot = rng.state_dict()
    calls = [0]

    def run(*a: object):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a)
        now = rng.state_dict()
        rng.load_state_dict(snapshot)
        try:
            return fn(*a)
        finally:
            rng.load_state_dict(now)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False)


def recompute_segments(
    num_layers: int, policy: str, method: str, group: int
) -> list[tuple[int, int, bool]]:
    """``(start, end, checkpointed)`` runs of a chunk's ``num_layers`` layers (pure)."""
    if policy != "full":
        return [(0, num_layers, False)]
    if method == "uniform":
        return [(s, min(s + group, num_layers), True) for s in range(0, num_layers, group)]
    first = min(group, num_layers)
    segments = [(i, i + 1, True) for i in range(first)]
    if first < num_layers:
        segments.append((first, num_layers, False))
    return segments


def apply_recompute(
    chunks: Iterable[GPTChunk], policy: str, method: str, num_layers: int, rng: RNGTracker
) -> None:
    """Install a recompute policy on model chunks (``GPTChunk``)."""
    for chunk in chunks:
        chunk.segments = recompute_segments(len(chunk.layers), policy, method, num_layers)
        chunk.recompute_rng = rng
        for block in chunk.layers.values():
            block.attn.core_runner = (
                (lambda fn, *a: checkpointed(fn, *a, rng=rng)) if policy == "selective" else None
            )
