"""ModelSpec: the fully resolved shape of the model (no nulls), built from the config.

A layer of its own, below every package that reads it (moe/, model/, plan/, hf/, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatronish.config.derived import default_ffn_hidden, pad_vocab

if TYPE_CHECKING:
    from megatronish.config.schema import ModelConfig


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts part of a model (see ``model.moe`` in the config)."""

    num_experts: int
    top_k: int
    layer_freq: int
    ffn_hidden_size: int  # of one expert
    shared_experts: int = 0
    capacity_factor: float | None = None  # None: dropless
    renormalize: bool = True
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    score: str = "softmax"  # softmax | sigmoid
    bias_update_rate: float | None = None  # None: no expert bias (aux-loss-free balancing off)
    num_groups: int | None = None  # group-limited routing: None for none
    max_groups: int | None = None

    def is_moe_layer(self, layer: int) -> bool:
        """Megatron's rule: every ``layer_freq``-th block, starting with block 0."""
        return layer % self.layer_freq == 0

    def num_moe_layers(self, num_layers: int) -> int:
        return sum(self.is_moe_layer(i) for i in range(num_layers))


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    seq_length: int
    vocab_size: int  # real tokens
    padded_vocab_size: int  # multiple of make_vocab_size_divisible_by; padding ids never win
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    bias: bool = False
    tie_embeddings: bool = False
    moe: MoESpec | None = None  # None: every block is dense
    kv_channels: int | None = None  # width of one attention head; None: hidden / heads
    qk_norm: bool = False  # each query and key head normalised before RoPE
    # Model FLOPs only: the keys a token's attention is counted over (None: seq_length; with
    # document masks the mean length of a token's document within its window)
    attended_keys: float | None = None

    @property
    def attention_span(self) -> float:
        """Keys per token in the attention FLOPs: ``attended_keys``, else ``seq_length``."""
        return float(self.seq_length if self.attended_keys is None else self.attended_keys)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_heads

    def kv_heads_per_rank(self, tp: int) -> int:
        """Key/value heads each of ``tp`` ranks holds: ``num_kv_heads / tp``, or one head
        replicated on ``tp / num_kv_heads`` ranks when there are fewer kv heads than ranks."""
        return max(1, self.num_kv_heads // tp)

    @property
    def attention_width(self) -> int:
        """Query heads times their width: the attention core's and the projection's width
        (``hidden_size`` unless ``head_dim`` is set otherwise)."""
        return self.num_heads * self.head_dim

    @property
    def is_llama(self) -> bool:
        return self.arch == "llama"

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, vocab_size: int) -> ModelSpec:
        """Resolve every null in ``model_cfg`` (``vocab_size`` is the tokenizer's when unset)."""
        m = model_cfg
        vocab = m.vocab_size or vocab_size
        gpt2 = m.arch == "gpt2"
        ffn = m.ffn_hidden_size or default_ffn_hidden(m.arch, m.hidden_size)
        return cls(
            arch=m.arch,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_heads=m.num_attention_heads,
            num_kv_heads=m.num_query_groups or m.num_attention_heads,
            ffn_hidden_size=ffn,
            seq_length=m.seq_length,
            vocab_size=vocab,
            padded_vocab_size=pad_vocab(vocab, m.make_vocab_size_divisible_by),
            max_position_embeddings=m.max_position_embeddings or m.seq_length,
            norm_eps=m.norm_eps,
            rope_theta=m.rope_theta,
            hidden_dropout=m.hidden_dropout,
            attention_dropout=m.attention_dropout,
            init_std=m.init_std,
            bias=gpt2 if m.bias is None else m.bias,
            tie_embeddings=gpt2 if m.tie_embeddings is None else m.tie_embeddings,
            moe=moe_spec(m, ffn),
            kv_channels=m.head_dim,
            qk_norm=m.qk_norm,
        )


def moe_spec(model_cfg: ModelConfig, ffn_hidden_size: int) -> MoESpec | None:
    """The resolved ``model.moe`` group (None for a dense model)."""
    moe = getattr(model_cfg, "moe", None)
    if moe is None or not moe.num_experts:
        return None
    return MoESpec(
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        layer_freq=moe.layer_freq,
        ffn_hidden_size=moe.ffn_hidden_size or ffn_hidden_size,
        shared_experts=moe.shared_experts,
        capacity_factor=moe.capacity_factor,
        renormalize=moe.router.renormalize,
        aux_loss_coef=moe.router.aux_loss_coef,
        z_loss_coef=moe.router.z_loss_coef,
        score=moe.router.score,
        bias_update_rate=moe.router.bias_update_rate,
        num_groups=moe.router.num_groups,
        max_groups=moe.router.max_groups,
    )
