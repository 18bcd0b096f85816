"""Model FLOPs and parameter counts of a :class:`ModelSpec` (pure).

Model FLOPs per token (the PaLM / Chinchilla convention, used by Megatron and torchtitan for MFU):

    flops_per_token = 6 * N + 12 * L * s * h

``N`` counts the weights of every matmul (attention, MLP and output head; not the embedding
lookup, positions or norms), the factor 6 is forward (2) plus backward (4), and ``12 L s h`` is
the attention score and value products (causal masking is not discounted). Recompute is not
counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

from megatronish.model.spec import ModelSpec


def matmul_params(spec: ModelSpec) -> int:
    """Weights that take part in matmuls (per full model)."""
    h, d = spec.hidden_size, spec.head_dim
    attn = h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * h
    mlp = (3 if spec.is_llama else 2) * h * spec.ffn_hidden_size
    return spec.num_layers * (attn + mlp) + spec.padded_vocab_size * h


def flops_per_token(spec: ModelSpec) -> float:
    """Model FLOPs per trained token (see module docstring)."""
    return 6.0 * matmul_params(spec) + 12.0 * spec.num_layers * spec.seq_length * spec.hidden_size


def count_parameters(spec: ModelSpec) -> int:
    """Total parameters of the full model (a tied head counted once)."""
    h, L = spec.hidden_size, spec.num_layers
    norm = h if spec.is_llama else 2 * h
    bias = 0
    if spec.bias:  # qkv + proj + fc1 (gate|up for llama) + fc2
        fc1 = (2 if spec.is_llama else 1) * spec.ffn_hidden_size
        bias = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim + h + fc1 + h
    per_layer = matmul_params(spec) - spec.padded_vocab_size * h
    total = per_layer + L * (2 * norm + bias) + norm + spec.padded_vocab_size * h
    if not spec.tie_embeddings:
        total += spec.padded_vocab_size * h
    if not spec.is_llama:
        total += spec.max_position_embeddings * h
    return total
