"""Recompute (``trainer.recompute``) in the plan: what a chunk keeps under each policy, what its
backward rebuilds, and the forward work and collectives it repeats.

The policies and their checkpointed groups are the trainer's
(:func:`~megatronish.model.recompute.recompute_segments`): ``selective`` drops the attention
core's saved tensors (the logsumexp, expanded K/V and any ``s x s`` tensors); ``full`` keeps one
``s_r b h`` input per checkpointed group and rebuilds the group's activations during its
backward. The bytes of the blocks themselves come from the caller (``blocks``: dense or
mixture-of-experts blocks, :func:`megatronish.plan.moe.blocks_bytes`), so this file knows the
policies, not what a block keeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from megatronish.config.validate import CHOICES
from megatronish.model.flops import matmul_params
from megatronish.model.recompute import recompute_segments
from megatronish.plan.layout import Layout
from megatronish.spec import ModelSpec

POLICIES: tuple[str, ...] = CHOICES["trainer.recompute"]  # none, selective, full

# Bytes a run of blocks keeps per microbatch: (which of them are mixtures of experts, whether the
# attention core's own tensors are kept) -> bytes.
BlocksBytes = Callable[..., int]


def policy(layout: Layout) -> tuple[str, str, int]:
    """The layout's recompute policy, method and group size (what the planner caches on)."""
    return layout.recompute, layout.recompute_method, layout.recompute_num_layers


def segments(layout: Layout, num_blocks: int) -> list[tuple[int, int, bool]]:
    """``(start, end, checkpointed)`` runs of a chunk's ``num_blocks`` blocks under the layout's
    policy (the trainer's groups)."""
    return recompute_segments(num_blocks, *policy(layout))


def peaks_in_backward(layout: Layout) -> bool:
    """Whether activations peak in a backward (full recompute rebuilds a group there) rather
    than at the end of a forward."""
    return layout.recompute == "full"


def keeps_attention_core(layout: Layout) -> bool:
    """Whether the blocks keep the attention core's saved tensors (all but ``selective``)."""
    return layout.recompute != "selective"


def chunk_body(
    layout: Layout, layers: int, flags: tuple, blocks: BlocksBytes, group_input: int
) -> int:
    """Bytes a chunk's ``layers`` blocks keep per microbatch until their backward
    (``group_input``: one checkpointed group's input, the hidden state of a microbatch)."""
    flags = flags or (False,) * layers
    if layout.recompute == "full":
        n = layout.recompute_num_layers
        if layout.recompute_method == "uniform":
            return math.ceil(layers / n) * group_input
        return min(n, layers) * group_input + blocks(flags[n:])
    return blocks(flags, core=keeps_attention_core(layout))


def rebuild_workspace(
    layout: Layout, layers: int, flags: tuple, blocks: BlocksBytes, group_input: int
) -> int:
    """Net bytes a chunk's backward adds while it rebuilds its first checkpointed group (full
    recompute): that group's activations, less its input (already kept) and, under ``block``,
    the layers kept after the checkpointed ones (freed before it); with mixture-of-experts
    blocks (``flags``), the largest group's. 0 without full recompute."""
    if layout.recompute != "full":
        return 0
    n, flags = min(layout.recompute_num_layers, layers), flags or (False,) * layers
    runs = [flags[i : i + n] for i in range(0, layers, max(n, 1))]  # the checkpointed groups
    freed = 0
    if layout.recompute_method == "block":  # one layer at a time, the rest kept
        runs = [flags[i : i + 1] for i in range(n)]
        freed = blocks(flags[n:])
    rebuilt = max((blocks(r) for r in runs), default=0)
    return rebuilt - group_input - freed


def kept_per_layer(layout: Layout, mean_block: Callable[[bool], float], group_input: int) -> float:
    """Bytes a layer keeps per microbatch under the policy (``mean_block(core)``: a block's
    bytes, the model's mean; full recompute: its share of a checkpointed group's input)."""
    if layout.recompute != "full":
        return mean_block(keeps_attention_core(layout))
    n = layout.recompute_num_layers
    return group_input / n if layout.recompute_method == "uniform" else group_input


def reruns(spec: ModelSpec, layout: Layout, pp_rank: int) -> tuple[int, int]:
    """``(layers, groups)`` full recompute reruns on pipeline rank ``pp_rank`` per microbatch:
    the checkpointed layers of its chunks and the checkpointed groups they form."""
    layers = layout.chunk_layers(spec.num_layers)
    redo = groups = 0
    for c in layout.stage_chunks(pp_rank):
        for start, end, checkpointed in segments(layout, layers[c]):
            if checkpointed:
                redo += end - start
                groups += 1
    return redo, groups


def core_reruns(layout: Layout, n_layers: int) -> int:
    """Attention cores rerun per microbatch by selective recompute (each of ``n_layers``)."""
    return n_layers if layout.recompute == "selective" else 0


def recompute_flops_per_token(spec: ModelSpec, layout: Layout) -> float:
    """Extra forward FLOPs per token that recompute adds (hardware, not model, FLOPs)."""
    L, s, h = spec.num_layers, spec.attention_span, spec.hidden_size
    if layout.recompute == "selective":
        return 4.0 * L * s * h  # the attention scores and the weighted sum, forward only
    if layout.recompute == "full":
        layer_weights = matmul_params(spec) - spec.padded_vocab_size * h
        share = 1.0
        if layout.recompute_method == "block":
            per_chunk = layout.chunk_layers(L)
            share = sum(min(layout.recompute_num_layers, n) for n in per_chunk) / L
        return share * (2.0 * layer_weights + 4.0 * L * s * h)
    return 0.0
