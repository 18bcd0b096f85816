"""A Hugging Face Llama / GPT-2 / Mixtral / Qwen3 / Qwen3-MoE config and state dict ->
megatronish's config and tensors (pure).

See :mod:`megatronish.hf.common` (:mod:`megatronish.hf.mixtral`, :mod:`megatronish.hf.qwen3`)
for the name mapping.
Imports add zero rows up to a multiple of 128 and refuse what megatronish cannot represent.
"""

from __future__ import annotations

import dataclasses

import torch

from megatronish.config.derived import pad_vocab
from megatronish.config.schema import ModelConfig
from megatronish.hf.common import GPT2_ACTIVATIONS, VOCAB_MULTIPLE, own_copy
from megatronish.hf.mixtral import moe_config, moe_from_hf
from megatronish.hf.qwen3 import (
    QWEN3_DEFAULTS,
    experts_from_qwen3,
    qk_norms_from_hf,
    qwen3_model_values,
)

# config.json values a Llama / Mixtral config leaves out take its class's defaults.
LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 1e4, "max_position_embeddings": 2048}
MIXTRAL_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072}


def from_hf(
    hf_config: dict, hf_state: dict[str, torch.Tensor], seq_length: int | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model config dict, global fp32 tensors)`` of the megatronish model equal to the HF one.

    The embedding (and an untied head) gets zero rows up to a multiple of 128. ``seq_length``
    defaults to the HF model's maximum positions. Raises ``ValueError`` for HF features
    megatronish does not have (RoPE scaling, exact-erf GELU, GPT-2 layer-index scaling, a Mixtral
    sliding window shorter than the sequence, ...).
    """
    arch = hf_config.get("model_type")
    if arch == "llama":
        cfg = _llama_model_cfg(hf_config)
        source = _Source(hf_state)
        tensors = _llama_from_hf(source, cfg)
    elif arch == "mixtral":
        cfg = _llama_model_cfg(hf_config, MIXTRAL_DEFAULTS, "Mixtral")
        seq = seq_length or cfg["max_position_embeddings"]
        cfg["moe"] = moe_config(hf_config, seq)
        source = _Source(hf_state)
        tensors = _llama_from_hf(source, cfg)
    elif arch in ("qwen3", "qwen3_moe"):
        cfg = _llama_model_cfg(hf_config, QWEN3_DEFAULTS, "Qwen3")
        seq = seq_length or cfg["max_position_embeddings"]
        cfg.update(qwen3_model_values(hf_config, seq))
        source = _Source(hf_state)
        tensors = _llama_from_hf(source, cfg)
    elif arch == "gpt2":
        cfg = _gpt2_model_cfg(hf_config)
        source = _Source({_strip_gpt2(k): v for k, v in hf_state.items()})
        tensors = _gpt2_from_hf(source, cfg)
    else:
        raise ValueError(
            f"cannot import model_type={arch!r} (llama, mixtral, qwen3, qwen3_moe or gpt2)"
        )
    source.check_all_used(cfg["tie_embeddings"])
    cfg["seq_length"] = seq_length or cfg["max_position_embeddings"]
    padded = pad_vocab(cfg["vocab_size"], VOCAB_MULTIPLE)
    for name in ("embedding.word.weight", "head.weight"):
        if name in tensors:
            w = tensors[name]
            tensors[name] = torch.cat([w, w.new_zeros(padded - w.shape[0], w.shape[1])])
    return cfg, {k: own_copy(v, torch.float32) for k, v in tensors.items()}


def _model_cfg(arch: str, hf: dict, **values: object) -> dict:
    base = dataclasses.asdict(ModelConfig())
    base.update(
        arch=arch,
        vocab_size=hf["vocab_size"],
        make_vocab_size_divisible_by=VOCAB_MULTIPLE,
        init_std=hf.get("initializer_range", base["init_std"]),
        **values,
    )
    return base


def _llama_model_cfg(hf: dict, defaults: dict = LLAMA_DEFAULTS, name: str = "Llama") -> dict:
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = []
    if rope_type != "default":
        problems.append(f"RoPE scaling {rope_type!r}")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (megatronish llama uses silu)")
    if problems:
        raise ValueError(f"this {name} model cannot be represented: " + "; ".join(problems))
    return _model_cfg(
        "llama",
        hf,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf.get(
            "max_position_embeddings", defaults["max_position_embeddings"]
        ),
        norm_eps=hf.get("rms_norm_eps", defaults["rms_norm_eps"]),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", defaults["rope_theta"]))),
        attention_dropout=hf.get("attention_dropout", 0.0),
        bias=bool(hf.get("attention_bias") or hf.get("mlp_bias")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=hf.get("head_dim") if hf.get("head_dim") != hidden // heads else None,
    )


def _gpt2_model_cfg(hf: dict) -> dict:
    act = hf.get("activation_function", "gelu_new")
    problems = []
    if act not in GPT2_ACTIVATIONS:
        problems.append(f"activation_function={act!r} (megatronish gpt2: tanh-approximate GELU)")
    if hf.get("scale_attn_by_inverse_layer_idx"):
        problems.append("scale_attn_by_inverse_layer_idx=true")
    if not hf.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=false")
    if problems:
        raise ValueError("this GPT-2 model cannot be represented: " + "; ".join(problems))
    hidden = hf["n_embd"]
    return _model_cfg(
        "gpt2",
        hf,
        num_layers=hf["n_layer"],
        hidden_size=hidden,
        num_attention_heads=hf["n_head"],
        num_query_groups=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
        max_position_embeddings=hf["n_positions"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        hidden_dropout=hf.get("resid_pdrop", 0.0),
        attention_dropout=hf.get("attn_pdrop", 0.0),
        bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


# Buffers some HF checkpoints carry that are recomputed, never learned.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")


class _Source:
    """An HF state dict that remembers which tensors were used (so nothing is silently lost)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state, self.used = state, set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"the HF state dict has no {name!r}")
        self.used.add(name)
        return self.state[name]

    def has(self, name: str) -> bool:
        return name in self.state

    def take_or_zeros(self, name: str, n: int) -> torch.Tensor:
        return self.take(name) if name in self.state else torch.zeros(n)

    def check_all_used(self, tied: bool) -> None:
        left = [k for k in self.state if k not in self.used and not k.endswith(IGNORED_SUFFIXES)]
        if tied:
            left = [k for k in left if k != "lm_head.weight"]
        if left:
            raise ValueError(f"HF tensors megatronish has no place for: {sorted(left)[:8]}")


def _llama_from_hf(s: _Source, cfg: dict) -> dict:
    """Llama's tensors; Qwen3's when ``cfg`` has ``qk_norm``; Mixtral's (Qwen3-MoE's) when it
    has a ``moe`` group with experts."""
    h, f, bias = cfg["hidden_size"], cfg["ffn_hidden_size"], cfg["bias"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    experts = (cfg.get("moe") or {}).get("num_experts")  # Mixtral, Qwen3-MoE: every block
    qwen3 = bool(cfg.get("qk_norm"))
    out = {"embedding.word.weight": s.take("model.embed_tokens.weight")}
    for i in range(cfg["num_layers"]):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out[dst + "attn_norm.weight"] = s.take(src + "input_layernorm.weight")
        out[dst + "mlp_norm.weight"] = s.take(src + "post_attention_layernorm.weight")
        out[dst + "attn.qkv.weight"] = torch.cat([s.take(f"{attn}{p}_proj.weight") for p in "qkv"])
        out[dst + "attn.proj.weight"] = s.take(attn + "o_proj.weight")
        if qwen3:
            out.update(qk_norms_from_hf(s, i))
        if experts:
            out.update(experts_from_qwen3(s, i, experts) if qwen3 else moe_from_hf(s, i, experts))
        else:
            out[dst + "mlp.fc1.weight"] = torch.cat(
                [s.take(mlp + "gate_proj.weight"), s.take(mlp + "up_proj.weight")]
            )
            out[dst + "mlp.fc2.weight"] = s.take(mlp + "down_proj.weight")
        if bias:
            rows = [cfg["num_attention_heads"] * d] + [cfg["num_query_groups"] * d] * 2
            qkv = [s.take_or_zeros(f"{attn}{p}_proj.bias", n) for p, n in zip("qkv", rows)]
            out[dst + "attn.qkv.bias"] = torch.cat(qkv)
            out[dst + "attn.proj.bias"] = s.take_or_zeros(attn + "o_proj.bias", h)
            fc1 = [s.take_or_zeros(f"{mlp}{p}_proj.bias", f) for p in ("gate", "up")]
            out[dst + "mlp.fc1.bias"] = torch.cat(fc1)
            out[dst + "mlp.fc2.bias"] = s.take_or_zeros(mlp + "down_proj.bias", h)
    out["head.norm.weight"] = s.take("model.norm.weight")
    if not cfg["tie_embeddings"]:
        out["head.weight"] = s.take("lm_head.weight")
    return out


def _strip_gpt2(name: str) -> str:
    """GPT-2 checkpoints name the trunk ``transformer.h.0...`` or (older ones) ``h.0...``."""
    return name.removeprefix("transformer.")


def _gpt2_from_hf(s: _Source, cfg: dict) -> dict:
    out = {
        "embedding.word.weight": s.take("wte.weight"),
        "embedding.position": s.take("wpe.weight"),
    }
    linears = {
        "attn.qkv": "attn.c_attn",
        "attn.proj": "attn.c_proj",
        "mlp.fc1": "mlp.c_fc",
        "mlp.fc2": "mlp.c_proj",
    }
    for i in range(cfg["num_layers"]):
        src, dst = f"h.{i}.", f"layers.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[f"{dst}{ours}.weight"] = s.take(f"{src}{theirs}.weight")
            out[f"{dst}{ours}.bias"] = s.take(f"{src}{theirs}.bias")
        for ours, theirs in linears.items():
            out[f"{dst}{ours}.weight"] = s.take(f"{src}{theirs}.weight").t()  # Conv1D [in, out]
            out[f"{dst}{ours}.bias"] = s.take(f"{src}{theirs}.bias")
    out["head.norm.weight"] = s.take("ln_f.weight")
    out["head.norm.bias"] = s.take("ln_f.bias")
    if not cfg["tie_embeddings"]:
        out["head.weight"] = s.take("lm_head.weight")
    return out
