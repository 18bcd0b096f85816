"""ModelSpec: the fully resolved shape of the model (no nulls), built from the config."""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.config.derived import default_ffn_hidden, pad_vocab


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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def is_llama(self) -> bool:
        return self.arch == "llama"

    @classmethod
    def from_config(cls, model_cfg, vocab_size: int) -> ModelSpec:
        """Resolve every null in ``model_cfg`` (``vocab_size`` is the tokenizer's when unset)."""
        m = model_cfg
        vocab = m.vocab_size or vocab_size
        gpt2 = m.arch == "gpt2"
        return cls(
            arch=m.arch,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_heads=m.num_attention_heads,
            num_kv_heads=m.num_query_groups or m.num_attention_heads,
            ffn_hidden_size=m.ffn_hidden_size or default_ffn_hidden(m.arch, m.hidden_size),
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
        )
