"""Mixtral (``MixtralForCausalLM``): a llama whose every MLP is a top-k mixture of experts.

Attention, norms, embedding and head map as for Llama (:mod:`megatronish.hf.common`); block i's
MLP maps like this (``E`` experts of ``f`` hidden units, global tensors):

=============================  ============================================================
megatronish                    Mixtral checkpoint (``model.layers.i.block_sparse_moe.``)
=============================  ============================================================
layers.i.mlp.router [E, h]     gate.weight
layers.i.mlp.experts.fc1       experts.j.w1.weight (gate, rows [0, f) of fc1[j]) and
[E, 2f, h]                     experts.j.w3.weight (up, rows [f, 2f))
layers.i.mlp.experts.fc2       experts.j.w2.weight (down) = fc2[j]
[E, h, f]
=============================  ============================================================

Exports write these per-expert names: they are what Mixtral checkpoints on the Hub hold, what
``save_pretrained`` writes (transformers 5 fuses them into ``mlp.experts.gate_up_proj`` /
``down_proj`` when loading) and what older readers understand. Imports also take the fused
names of a transformers 5 ``state_dict()``, whose layout is exactly ``fc1`` / ``fc2``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatronish.hf.experts import (
    ExpertNames,
    experts_from_hf,
    experts_to_hf,
    plain_router,
    plain_router_problems,
)
from megatronish.spec import ModelSpec

if TYPE_CHECKING:
    from megatronish.hf.from_hf import _Source

MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight")


def mixtral_config(spec: ModelSpec, llama: dict) -> dict:
    """The ``config.json`` entries of the Mixtral equal to ``spec``; ``ValueError`` when Mixtral
    cannot hold the model (``llama``: the Llama config of the same attention, norms and
    embeddings, which Mixtral shares)."""
    moe = spec.moe
    problems = []
    if not spec.is_llama:
        problems.append(
            f"model.arch={spec.arch!r}: Mixtral blocks are llama blocks (RMSNorm, RoPE, SwiGLU)"
        )
    if moe.layer_freq != 1:
        problems.append(
            f"model.moe.layer_freq={moe.layer_freq} leaves some blocks dense, but every Mixtral "
            "block is a mixture of experts"
        )
    if not moe.renormalize:
        problems.append(
            "model.moe.router.renormalize=false: Mixtral always rescales the top-k router "
            "weights to sum to 1"
        )
    problems += plain_router_problems(moe, "Mixtral")
    if spec.bias:
        problems.append("model.bias=true: Mixtral's linear layers have no biases")
    if problems:
        raise ValueError("cannot export as MixtralForCausalLM: " + "; ".join(problems))
    # capacity_factor and the z-loss only shape training: Mixtral runs dropless, and the z-loss
    # coefficient has no place in its config.
    llama = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    return {
        **llama,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": moe.ffn_hidden_size,
        "sliding_window": None,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        # The same number, not the same loss: see moe_config below.
        "router_aux_loss_coef": moe.aux_loss_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


def moe_config(hf: dict, seq_length: int) -> dict:
    """The ``model.moe`` group of a Mixtral ``config.json``; ``ValueError`` for what megatronish
    does not implement. ``seq_length``: the sequence the imported model will train on."""
    window = hf.get("sliding_window")
    if window is not None and window < seq_length:
        raise ValueError(
            f"this Mixtral model cannot be represented: sliding_window={window} is shorter than "
            f"the sequence ({seq_length} tokens) and megatronish attends to every earlier token; "
            f"import with a sequence length of at most {window}"
        )
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(
            "this Mixtral model cannot be represented: attention_bias / mlp_bias are not "
            "Mixtral's, and megatronish's experts have no biases"
        )
    # router_jitter_noise multiplies the router's input by noise in training only; the model's
    # function is the same without it, so it is dropped.
    return {
        "num_experts": hf["num_local_experts"],
        "top_k": hf["num_experts_per_tok"],
        "layer_freq": 1,
        "ffn_hidden_size": hf["intermediate_size"],
        "shared_experts": 0,
        "capacity_factor": None,
        # The coefficient is carried over as is, but the losses differ: transformers' is taken
        # once over every layer's tokens and counts all k slots (k at perfect balance),
        # megatronish's (Megatron-LM's) is per layer, divided by k and summed (the number of
        # MoE layers at balance).
        "router": plain_router(True, float(hf.get("router_aux_loss_coef", 0.001))),
    }


def moe_to_hf(t: dict, layer: int, num_experts: int, f: int) -> dict:
    """Block ``layer``'s router and experts under Mixtral checkpoint names."""
    return experts_to_hf(t, layer, num_experts, f, MIXTRAL_EXPERTS)


def moe_from_hf(s: _Source, layer: int, num_experts: int) -> dict:
    """Block ``layer``'s router and experts from Mixtral's checkpoint or fused names."""
    return experts_from_hf(s, layer, num_experts, MIXTRAL_EXPERTS)
