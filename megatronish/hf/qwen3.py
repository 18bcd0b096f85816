"""Qwen3 (``Qwen3ForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``): llama blocks whose
query and key heads are each RMS-normalised before RoPE, with a head width of their own.

megatronish holds them as ``model.arch=llama`` with ``model.qk_norm=true`` and ``model.head_dim``;
attention, norms, embedding and head map as for Llama (:mod:`megatronish.hf.common`), plus:

==========================  ===================================================================
megatronish                 Qwen3 / Qwen3-MoE (``model.layers.i.``)
==========================  ===================================================================
layers.i.attn.q_norm.weight self_attn.q_norm.weight ``[head_dim]``
layers.i.attn.k_norm.weight self_attn.k_norm.weight
layers.i.mlp.router         mlp.gate.weight (Qwen3-MoE)
layers.i.mlp.experts.fc1    mlp.experts.j.gate_proj.weight (rows [0, f)) and up_proj (rows
                            [f, 2f)); transformers 5's fused mlp.experts.gate_up_proj on import
layers.i.mlp.experts.fc2    mlp.experts.j.down_proj.weight; fused mlp.experts.down_proj
==========================  ===================================================================

Qwen3-MoE's router is a softmax whose top-k weights are rescaled to sum 1 when
``norm_topk_prob`` (megatronish's ``model.moe.router.renormalize``); it has no shared experts.
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

QWEN3_EXPERTS = ExpertNames("mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight")
QWEN3_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 1e4, "max_position_embeddings": 32768}
QK_NORMS = ("q_norm", "k_norm")


def qwen3_config(spec: ModelSpec, llama: dict) -> dict:
    """The ``config.json`` entries of the Qwen3 or Qwen3-MoE equal to ``spec`` (a llama with
    ``qk_norm``); ``ValueError`` when neither can hold the model. ``llama``: the Llama config of
    the same attention, norms and embeddings."""
    moe = spec.moe
    problems = []
    if spec.bias:
        problems.append("model.bias=true: Qwen3's MLPs have no biases")
    if moe is not None:
        if moe.layer_freq != 1:
            problems.append(
                f"model.moe.layer_freq={moe.layer_freq}: megatronish's experts sit in blocks "
                "0, f, 2f, ..., Qwen3-MoE's (decoder_sparse_step) in blocks f-1, 2f-1, ..."
            )
        problems += plain_router_problems(moe, "Qwen3-MoE")
    if problems:
        name = "Qwen3MoeForCausalLM" if moe is not None else "Qwen3ForCausalLM"
        raise ValueError(f"cannot export as {name}: " + "; ".join(problems))
    llama = {k: v for k, v in llama.items() if k not in ("mlp_bias",)}
    common = {
        **llama,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": spec.num_layers,
    }
    if moe is None:
        return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    return {
        **common,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": moe.ffn_hidden_size,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # The same number, not the same loss (as for Mixtral: transformers' is taken once over
        # every layer's tokens, megatronish's per layer).
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": False,
    }


def qwen3_model_values(hf: dict, seq_length: int) -> dict:
    """The ``model`` values a Qwen3 / Qwen3-MoE ``config.json`` sets beyond Llama's (head width,
    per-head norms; Qwen3-MoE: the ``moe`` group); ``ValueError`` for what megatronish does not
    implement. ``seq_length``: the sequence the imported model will train on."""
    problems = []
    window = hf.get("sliding_window")
    sliding = hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or [])
    if sliding and window is not None and window < seq_length:
        problems.append(
            f"sliding_window={window} is shorter than the sequence ({seq_length} tokens) and "
            f"megatronish attends to every earlier token; import with a sequence length of at "
            f"most {window}"
        )
    if hf.get("attention_bias"):
        problems.append("attention_bias=true (megatronish's biases would give the MLPs some too)")
    moe = hf.get("model_type") == "qwen3_moe"
    if moe and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
        problems.append(
            f"decoder_sparse_step={hf.get('decoder_sparse_step')}, mlp_only_layers="
            f"{hf.get('mlp_only_layers')}: megatronish puts experts in every block or in blocks "
            "0, f, 2f, ... (model.moe.layer_freq)"
        )
    if problems:
        raise ValueError("this Qwen3 model cannot be represented: " + "; ".join(problems))
    heads = hf["num_attention_heads"]
    values = {"head_dim": hf.get("head_dim") or hf["hidden_size"] // heads, "qk_norm": True}
    if not moe:
        return values
    values["moe"] = {
        "num_experts": hf.get("num_experts", hf.get("num_local_experts")),
        "top_k": hf["num_experts_per_tok"],
        "layer_freq": 1,
        "ffn_hidden_size": hf["moe_intermediate_size"],
        "shared_experts": 0,
        "capacity_factor": None,
        "router": plain_router(
            bool(hf.get("norm_topk_prob", False)), float(hf.get("router_aux_loss_coef", 0.001))
        ),
    }
    return values


def qk_norms_to_hf(t: dict, layer: int) -> dict:
    """Block ``layer``'s per-head query and key norm weights under Qwen3's names."""
    src, dst = f"layers.{layer}.attn.", f"model.layers.{layer}.self_attn."
    return {f"{dst}{n}.weight": t[f"{src}{n}.weight"] for n in QK_NORMS}


def qk_norms_from_hf(s: _Source, layer: int) -> dict:
    """Block ``layer``'s per-head query and key norm weights from Qwen3's names."""
    src, dst = f"model.layers.{layer}.self_attn.", f"layers.{layer}.attn."
    return {f"{dst}{n}.weight": s.take(f"{src}{n}.weight") for n in QK_NORMS}


def experts_to_qwen3(t: dict, layer: int, num_experts: int, f: int) -> dict:
    """Block ``layer``'s router and experts under Qwen3-MoE checkpoint names."""
    return experts_to_hf(t, layer, num_experts, f, QWEN3_EXPERTS)


def experts_from_qwen3(s: _Source, layer: int, num_experts: int) -> dict:
    """Block ``layer``'s router and experts from Qwen3-MoE's checkpoint or fused names."""
    return experts_from_hf(s, layer, num_experts, QWEN3_EXPERTS)
