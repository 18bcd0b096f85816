"""Model FLOPs and parameter counts of a :class:`ModelSpec` (pure).

Model FLOPs per token (the PaLM / Chinchilla convention, used by Megatron and torchtitan for MFU):

    flops_per_token = 6 * N + 12 * L * s * a * d

``N`` counts the weights of every matmul (attention, MLP and output head; not the embedding
lookup, positions or norms), the factor 6 is forward (2) plus backward (4), and ``12 L s a d`` is
the attention score and value products over ``a`` query heads of width ``d`` (``a d = h``
unless ``model.head_dim`` says otherwise; causal masking is not discounted). Recompute is not
counted (model FLOPs, not hardware FLOPs). With document masks (packed documents) a token
attends within its document only: ``s`` becomes ``ModelSpec.attention_span``, the mean over
tokens of their document's length in the window (``sum l^2 / s`` per window, the documents'
``l^2`` in place of the window's ``s^2``).

Mixture of experts: ``N`` counts the *active* weights a token meets, so a mixture-of-experts
block contributes its router (``E h``), ``top_k`` of its experts and its shared experts;
:func:`count_parameters` counts every expert (the total), :func:`active_parameters` only the
ones a token uses.
"""

from __future__ import annotations

from megatronish.spec import ModelSpec


def _mlp_weights(spec: ModelSpec, ffn: int) -> int:
    """Weights of one SwiGLU (llama: gate, up, down) or GELU (gpt2: fc1, fc2) MLP."""
    return (3 if spec.is_llama else 2) * spec.hidden_size * ffn


def expert_weights(spec: ModelSpec) -> int:
    """Weights of one expert (0 for a dense model)."""
    return 0 if spec.moe is None else _mlp_weights(spec, spec.moe.ffn_hidden_size)


def _attention_weights(spec: ModelSpec) -> int:
    h, d = spec.hidden_size, spec.head_dim
    return h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.attention_width * h


def layer_matmul_params(spec: ModelSpec, layer: int, active: bool = True) -> int:
    """Matmul weights of block ``layer``: a mixture-of-experts block counts its router, its
    shared experts and ``top_k`` experts (``active``) or all of them."""
    attn = _attention_weights(spec)
    if not spec.is_moe_layer(layer):
        return attn + _mlp_weights(spec, spec.ffn_hidden_size)
    moe = spec.moe
    experts = moe.top_k if active else moe.num_experts
    shared = _mlp_weights(spec, moe.shared_experts * moe.ffn_hidden_size)
    return attn + moe.num_experts * spec.hidden_size + experts * expert_weights(spec) + shared


def matmul_params(spec: ModelSpec) -> int:
    """Weights that take part in a token's matmuls (per full model; experts: the active ones)."""
    h = spec.hidden_size
    if spec.moe is None:
        return spec.num_layers * _layer_matmul_dense(spec) + spec.padded_vocab_size * h
    layers = sum(layer_matmul_params(spec, i) for i in range(spec.num_layers))
    return layers + spec.padded_vocab_size * h


def _layer_matmul_dense(spec: ModelSpec) -> int:
    return _attention_weights(spec) + _mlp_weights(spec, spec.ffn_hidden_size)


def flops_per_token(spec: ModelSpec) -> float:
    """Model FLOPs per trained token (see module docstring)."""
    attention = 12.0 * spec.num_layers * spec.attention_span * spec.attention_width
    return 6.0 * matmul_params(spec) + attention


def split_backward_times(spec: ModelSpec) -> tuple[float, float, float]:
    """Relative model FLOPs of a chunk's forward, input-gradient backward (B) and weight-gradient
    backward (W) per token: ``2N + 4Lsad``, ``2N + 8Lsad`` and ``2N`` (the attention core has no
    weights: its whole backward is B)."""
    matmul = 2.0 * matmul_params(spec)
    attention = 4.0 * spec.num_layers * spec.attention_span * spec.attention_width
    return matmul + attention, matmul + 2 * attention, matmul


def _layer_bias(spec: ModelSpec, layer: int) -> int:
    """Biases of block ``layer``: qkv and proj; a dense MLP's fc1 and fc2 (experts have none)."""
    if not spec.bias:
        return 0
    h = spec.hidden_size
    attn = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim + h
    if spec.is_moe_layer(layer):
        return attn
    return attn + (2 if spec.is_llama else 1) * spec.ffn_hidden_size + h


def count_parameters(spec: ModelSpec) -> int:
    """Total parameters of the full model (a tied head counted once; every expert)."""
    h, L = spec.hidden_size, spec.num_layers
    norm = h if spec.is_llama else 2 * h
    if spec.moe is None:
        per_layer = L * (_layer_matmul_dense(spec) + _layer_bias(spec, 0))
    else:
        per_layer = sum(
            layer_matmul_params(spec, i, active=False) + _layer_bias(spec, i) for i in range(L)
        )
    if spec.qk_norm:  # one weight (LayerNorm: and a bias) per head width, for Q and for K
        per_layer += L * 2 * (norm // h) * spec.head_dim
    total = per_layer + L * 2 * norm + norm + spec.padded_vocab_size * h
    if not spec.tie_embeddings:
        total += spec.padded_vocab_size * h
    if not spec.is_llama:
        total += spec.max_position_embeddings * h
    return total


def active_parameters(spec: ModelSpec) -> int:
    """Parameters a token uses: :func:`count_parameters` with ``top_k`` experts per
    mixture-of-experts block instead of all of them (the total for a dense model)."""
    if spec.moe is None:
        return count_parameters(spec)
    idle = spec.moe.num_experts - spec.moe.top_k
    return count_parameters(spec) - spec.moe.num_moe_layers(spec.num_layers) * idle * (
        expert_weights(spec)
    )
