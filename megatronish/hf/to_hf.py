"""megatronish global tensors -> a Hugging Face Llama / GPT-2 / Mixtral / Qwen3 / Qwen3-MoE
config and state dict.

See :mod:`megatronish.hf.common` (:mod:`megatronish.hf.mixtral`, :mod:`megatronish.hf.qwen3`)
for the name mapping.
Exports drop the embedding (and head) rows beyond the real vocabulary and write zeros for biases
megatronish does not have (pure).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from megatronish.hf.common import DEFAULT_SPECIAL_TOKENS, model_spec, own_copy
from megatronish.hf.mixtral import mixtral_config, moe_to_hf
from megatronish.hf.qwen3 import experts_to_qwen3, qk_norms_to_hf, qwen3_config
from megatronish.spec import ModelSpec

# Files of a Hugging Face model directory that describe a model besides the config.json and
# model.safetensors an export writes (an earlier export's or save_pretrained's): they would
# contradict the new model (transformers' generate takes its token ids from
# generation_config.json, which it reads over config.json's; sharded or pickled weights are a
# second copy of other weights), so an export into the directory removes them.
REPLACED_FILES = (
    "generation_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
WEIGHT_SHARD = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)")


def replaced_files(names: Iterable[str]) -> list[str]:
    """The names among ``names`` (a directory's files) that an export into it replaces: those
    of :data:`REPLACED_FILES` and weight shards (``model-00001-of-00002.safetensors``)."""
    return sorted(n for n in names if n in REPLACED_FILES or WEIGHT_SHARD.fullmatch(n))


def _zeros_if_missing(t: dict, name: str, n: int) -> torch.Tensor:
    return t[name] if name in t else torch.zeros(n)


def to_hf(
    tensors: dict[str, torch.Tensor],
    model_cfg: dict,
    vocab_size: int | None = None,
    dtype: torch.dtype | None = None,
    special_tokens: dict | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json dict, state dict)`` of the HF model equal to megatronish ``tensors``.

    ``tensors`` maps global names (without the ``model/`` prefix) to global tensors and
    ``model_cfg`` is the checkpoint's ``model`` config section; ``special_tokens`` its
    tokenizer's ids (:data:`DEFAULT_SPECIAL_TOKENS` when unknown). The vocabulary is cut to
    ``vocab_size`` (default ``model_cfg["vocab_size"]``; when both are unknown the padded size is
    kept, and the padding ids are then valid, never-trained tokens of the HF model).
    """
    padded = tensors["embedding.word.weight"].shape[0]
    vocab = vocab_size or model_cfg.get("vocab_size") or padded
    if vocab > padded:
        raise ValueError(f"vocab_size {vocab} is larger than the checkpoint's embedding ({padded})")
    spec = model_spec(model_cfg, vocab)
    if spec.padded_vocab_size != padded:
        raise ValueError(
            f"the embedding has {padded} rows but vocab {vocab} pads to {spec.padded_vocab_size}"
        )
    if spec.qk_norm:  # Qwen3 or Qwen3-MoE, or a ValueError saying why not
        if not spec.is_llama:
            raise ValueError(
                f"cannot export model.arch={spec.arch!r} with model.qk_norm=true (the HF models "
                "with per-head norms here are Qwen3's: llama blocks)"
            )
        config = qwen3_config(spec, _llama_config(spec, vocab))
        state = _llama_to_hf(tensors, spec, vocab)
    elif spec.moe is not None:  # Mixtral, or a ValueError saying why not
        config = mixtral_config(spec, _llama_config(spec, vocab))
        state = _llama_to_hf(tensors, spec, vocab)
    elif spec.arch == "llama":
        config, state = _llama_config(spec, vocab), _llama_to_hf(tensors, spec, vocab)
    elif spec.arch == "gpt2":
        config, state = _gpt2_config(spec, vocab), _gpt2_to_hf(tensors, spec, vocab)
    else:
        raise ValueError(f"cannot export model.arch={spec.arch!r} (llama or gpt2)")
    config.update(special_tokens or DEFAULT_SPECIAL_TOKENS)
    dtype = dtype or torch.float32
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    return config, {k: own_copy(v, dtype) for k, v in state.items()}


def _common_config(spec: ModelSpec, vocab: int) -> dict:
    return {
        "vocab_size": vocab,
        "initializer_range": spec.init_std,
        "tie_word_embeddings": spec.tie_embeddings,
        "use_cache": True,
    }


def _llama_config(spec: ModelSpec, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_common_config(spec, vocab),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.norm_eps,
        # transformers < 5 reads rope_theta, >= 5 reads rope_parameters.
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": spec.bias,
        "mlp_bias": spec.bias,
        "attention_dropout": spec.attention_dropout,
    }


def _gpt2_config(spec: ModelSpec, vocab: int) -> dict:
    if spec.attention_width != spec.hidden_size:
        raise ValueError(
            f"GPT-2's heads are hidden_size / n_head wide: model.head_dim={spec.head_dim} with "
            f"{spec.num_heads} heads is not {spec.hidden_size}"
        )
    if spec.num_kv_heads != spec.num_heads:
        raise ValueError(
            f"GPT-2 has no grouped-query attention: num_query_groups={spec.num_kv_heads} but "
            f"num_attention_heads={spec.num_heads}"
        )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **_common_config(spec, vocab),
        "n_embd": spec.hidden_size,
        "n_layer": spec.num_layers,
        "n_head": spec.num_heads,
        "n_inner": spec.ffn_hidden_size,
        "n_positions": spec.max_position_embeddings,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": spec.norm_eps,
        "resid_pdrop": spec.hidden_dropout,
        "embd_pdrop": spec.hidden_dropout,
        "attn_pdrop": spec.attention_dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


def _llama_to_hf(t: dict, spec: ModelSpec, vocab: int) -> dict:
    d, f = spec.head_dim, spec.ffn_hidden_size
    qkv_rows = [spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d]
    kinds = ("weight", "bias") if spec.bias else ("weight",)
    out = {"model.embed_tokens.weight": t["embedding.word.weight"][:vocab]}
    for i in range(spec.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = t[src + "attn_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = t[src + "mlp_norm.weight"]
        moe = spec.is_moe_layer(i)
        if spec.qk_norm:
            out.update(qk_norms_to_hf(t, i))
        if moe:
            experts_to = experts_to_qwen3 if spec.qk_norm else moe_to_hf
            out.update(experts_to(t, i, spec.moe.num_experts, spec.moe.ffn_hidden_size))
        for kind in kinds:
            q, k, v = t[f"{src}attn.qkv.{kind}"].split(qkv_rows)
            out.update(
                {
                    f"{dst}self_attn.q_proj.{kind}": q,
                    f"{dst}self_attn.k_proj.{kind}": k,
                    f"{dst}self_attn.v_proj.{kind}": v,
                    f"{dst}self_attn.o_proj.{kind}": t[f"{src}attn.proj.{kind}"],
                }
            )
            if not moe:
                gate, up = t[f"{src}mlp.fc1.{kind}"].split([f, f])
                out.update(
                    {
                        f"{dst}mlp.gate_proj.{kind}": gate,
                        f"{dst}mlp.up_proj.{kind}": up,
                        f"{dst}mlp.down_proj.{kind}": t[f"{src}mlp.fc2.{kind}"],
                    }
                )
    out["model.norm.weight"] = t["head.norm.weight"]
    if not spec.tie_embeddings:
        out["lm_head.weight"] = t["head.weight"][:vocab]
    return out


def _gpt2_to_hf(t: dict, spec: ModelSpec, vocab: int) -> dict:
    h, f = spec.hidden_size, spec.ffn_hidden_size
    out = {
        "transformer.wte.weight": t["embedding.word.weight"][:vocab],
        "transformer.wpe.weight": t["embedding.position"],
    }
    linears = {
        "attn.qkv": ("attn.c_attn", 3 * h),
        "attn.proj": ("attn.c_proj", h),
        "mlp.fc1": ("mlp.c_fc", f),
        "mlp.fc2": ("mlp.c_proj", h),
    }
    for i in range(spec.num_layers):
        src, dst = f"layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[f"{dst}{theirs}.weight"] = t[f"{src}{ours}.weight"]
            out[f"{dst}{theirs}.bias"] = t[f"{src}{ours}.bias"]
        for ours, (theirs, n_out) in linears.items():
            out[f"{dst}{theirs}.weight"] = t[f"{src}{ours}.weight"].t()  # Conv1D: [in, out]
            out[f"{dst}{theirs}.bias"] = _zeros_if_missing(t, f"{src}{ours}.bias", n_out)
    out["transformer.ln_f.weight"] = t["head.norm.weight"]
    out["transformer.ln_f.bias"] = t["head.norm.bias"]
    if not spec.tie_embeddings:
        out["lm_head.weight"] = t["head.weight"][:vocab]
    return out
