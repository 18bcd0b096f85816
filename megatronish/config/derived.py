"""Values derived from the config and the world size (pure functions)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatronish.config.schema import ModelConfig, ParallelConfig, TrainConfig


def pad_vocab(vocab_size: int, multiple: int) -> int:
    """Round the vocabulary up to ``multiple`` (independent of tp, so every layout is one model)."""
    return int(math.ceil(vocab_size / multiple) * multiple)


def default_ffn_hidden(arch: str, hidden: int) -> int:
    """llama: 8h/3 rounded up to a multiple of 64 (SwiGLU keeps ~4h^2*2 params); gpt2: 4h."""
    if arch == "llama":
        return int(math.ceil(8 * hidden / 3 / 64) * 64)
    return 4 * hidden


def even_layer_split(num_layers: int, chunks: int) -> list[int]:
    """Layers per chunk for an even split (the caller validated divisibility)."""
    return [num_layers // chunks] * chunks


@dataclass(frozen=True)
class Derived:
    """Quantities every part of the job agrees on."""

    world_size: int
    dp: int
    num_microbatches: int
    tokens_per_step: int
    ffn_hidden_size: int
    num_query_groups: int
    head_dim: int
    layers_per_chunk: tuple[int, ...]
    bias: bool
    tie_embeddings: bool
    max_position_embeddings: int


def model_widths(model: ModelConfig) -> tuple[int, int, int]:
    """``(ffn_hidden_size, num_query_groups, head_dim)`` with their defaults filled in."""
    m = model
    return (
        m.ffn_hidden_size or default_ffn_hidden(m.arch, m.hidden_size),
        m.num_query_groups or m.num_attention_heads,
        m.head_dim or m.hidden_size // m.num_attention_heads,
    )


def data_parallel_size(parallel: ParallelConfig, world_size: int) -> int:
    """``parallel.dp``, or when null what the world leaves: ``world_size / (tp * cp * pp)``."""
    p = parallel
    return p.dp if p.dp is not None else world_size // (p.tp * p.cp * p.pp)


def derive(cfg: TrainConfig, world_size: int) -> Derived:
    """Derived values of a config that passed validation."""
    m, p, t = cfg.model, cfg.parallel, cfg.trainer
    dp = data_parallel_size(p, world_size)
    chunks = p.pp * p.vpp
    split = p.pipeline_layer_split or even_layer_split(m.num_layers, chunks)
    gpt2 = m.arch == "gpt2"
    ffn, kv, head_dim = model_widths(m)
    return Derived(
        world_size=world_size,
        dp=dp,
        num_microbatches=t.global_batch_size // (t.micro_batch_size * dp),
        tokens_per_step=t.global_batch_size * m.seq_length,
        ffn_hidden_size=ffn,
        num_query_groups=kv,
        head_dim=head_dim,
        layers_per_chunk=tuple(split),
        bias=gpt2 if m.bias is None else m.bias,
        tie_embeddings=gpt2 if m.tie_embeddings is None else m.tie_embeddings,
        max_position_embeddings=m.max_position_embeddings or m.seq_length,
    )
