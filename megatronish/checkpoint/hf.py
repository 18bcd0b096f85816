"""Pure mappings between megatronish global tensors and Hugging Face Llama / GPT-2 state dicts.

megatronish names (global, unsplit; see :mod:`megatronish.model.gpt`) map to
``LlamaForCausalLM`` and ``GPT2LMHeadModel`` like this:

============================  ===================================  ==============================
megatronish                   llama                                gpt2 (Conv1D: ``[in, out]``)
============================  ===================================  ==============================
embedding.word.weight         model.embed_tokens.weight            transformer.wte.weight
embedding.position            -                                    transformer.wpe.weight
layers.i.attn_norm.*          model.layers.i.input_layernorm.*     transformer.h.i.ln_1.*
layers.i.attn.qkv.*           ...self_attn.{q,k,v}_proj.*          transformer.h.i.attn.c_attn.*
layers.i.attn.proj.*          ...self_attn.o_proj.*                transformer.h.i.attn.c_proj.*
layers.i.mlp_norm.*           ...post_attention_layernorm.*        transformer.h.i.ln_2.*
layers.i.mlp.fc1.*            ...mlp.{gate,up}_proj.*              transformer.h.i.mlp.c_fc.*
layers.i.mlp.fc2.*            ...mlp.down_proj.*                   transformer.h.i.mlp.c_proj.*
head.norm.*                   model.norm.*                         transformer.ln_f.*
head.weight (untied only)     lm_head.weight                       lm_head.weight
============================  ===================================  ==============================

The embedding (and head) rows beyond the real vocabulary are megatronish's padding: exports
drop them, imports add zero rows up to a multiple of 128. Both models use the rotate-half RoPE
convention and the same GQA head grouping, so q/k/v rows need no permutation. Linear biases
megatronish does not have (gpt2 with ``bias=false``) are exported as zeros; biases HF has only on
one side (llama ``attention_bias`` without ``mlp_bias``) are imported with zeros for the other.
Everything here works on CPU tensors in memory; no files, no transformers import.
"""

from __future__ import annotations

import dataclasses

import torch

from megatronish.config.derived import pad_vocab
from megatronish.config.schema import ModelConfig
from megatronish.model.spec import ModelSpec

VOCAB_MULTIPLE = 128
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # all the tanh approximation
# Megatronish's sentencepiece tokenizers: 0 <unk>, 1 <s>, 2 </s> (end of document), no padding.
# Exports of checkpoints that do not record their tokenizer's ids use these.
DEFAULT_SPECIAL_TOKENS = {"bos_token_id": 1, "eos_token_id": 2}


def model_spec(model_cfg: dict, vocab_size: int) -> ModelSpec:
    """The resolved :class:`ModelSpec` of a ``model`` config section stored as a plain dict."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelSpec.from_config(
        ModelConfig(**{k: v for k, v in model_cfg.items() if k in names}), vocab_size
    )


def _own(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous copy (safetensors refuses tensors that share memory)."""
    out = torch.empty(t.shape, dtype=dtype or t.dtype)
    return out.copy_(t)


def _zeros_if_missing(t: dict, name: str, n: int) -> torch.Tensor:
    return t[name] if name in t else torch.zeros(n)


# ---------------------------------------------------------------------------------------------
# megatronish -> Hugging Face


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
    if spec.arch == "llama":
        config, state = _llama_config(spec, vocab), _llama_to_hf(tensors, spec, vocab)
    elif spec.arch == "gpt2":
        config, state = _gpt2_config(spec, vocab), _gpt2_to_hf(tensors, spec, vocab)
    else:
        raise ValueError(f"cannot export model.arch={spec.arch!r} (llama or gpt2)")
    config.update(special_tokens or DEFAULT_SPECIAL_TOKENS)
    dtype = dtype or torch.float32
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    return config, {k: _own(v, dtype) for k, v in state.items()}


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
        for kind in kinds:
            q, k, v = t[f"{src}attn.qkv.{kind}"].split(qkv_rows)
            gate, up = t[f"{src}mlp.fc1.{kind}"].split([f, f])
            out.update({
                f"{dst}self_attn.q_proj.{kind}": q, f"{dst}self_attn.k_proj.{kind}": k,
                f"{dst}self_attn.v_proj.{kind}": v,
                f"{dst}self_attn.o_proj.{kind}": t[f"{src}attn.proj.{kind}"],
                f"{dst}mlp.gate_proj.{kind}": gate, f"{dst}mlp.up_proj.{kind}": up,
                f"{dst}mlp.down_proj.{kind}": t[f"{src}mlp.fc2.{kind}"],
            })  # fmt: skip
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
    linears = {"attn.qkv": ("attn.c_attn", 3 * h), "attn.proj": ("attn.c_proj", h),
               "mlp.fc1": ("mlp.c_fc", f), "mlp.fc2": ("mlp.c_proj", h)}  # fmt: skip
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


# ---------------------------------------------------------------------------------------------
# Hugging Face -> megatronish


def from_hf(
    hf_config: dict, hf_state: dict[str, torch.Tensor], seq_length: int | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model config dict, global fp32 tensors)`` of the megatronish model equal to the HF one.

    The embedding (and an untied head) gets zero rows up to a multiple of 128. ``seq_length``
    defaults to the HF model's maximum positions. Raises ``ValueError`` for HF features
    megatronish does not have (RoPE scaling, exact-erf GELU, GPT-2 layer-index scaling, ...).
    """
    arch = hf_config.get("model_type")
    if arch == "llama":
        cfg = _llama_model_cfg(hf_config)
        source = _Source(hf_state)
        tensors = _llama_from_hf(source, cfg)
    elif arch == "gpt2":
        cfg = _gpt2_model_cfg(hf_config)
        source = _Source({_strip_gpt2(k): v for k, v in hf_state.items()})
        tensors = _gpt2_from_hf(source, cfg)
    else:
        raise ValueError(f"cannot import model_type={arch!r} (llama or gpt2)")
    source.check_all_used(cfg["tie_embeddings"])
    cfg["seq_length"] = seq_length or cfg["max_position_embeddings"]
    padded = pad_vocab(cfg["vocab_size"], VOCAB_MULTIPLE)
    for name in ("embedding.word.weight", "head.weight"):
        if name in tensors:
            w = tensors[name]
            tensors[name] = torch.cat([w, w.new_zeros(padded - w.shape[0], w.shape[1])])
    return cfg, {k: _own(v, torch.float32) for k, v in tensors.items()}


def _model_cfg(arch: str, hf: dict, **values) -> dict:
    base = dataclasses.asdict(ModelConfig())
    base.update(arch=arch, vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=VOCAB_MULTIPLE,
                init_std=hf.get("initializer_range", base["init_std"]), **values)  # fmt: skip
    return base


def _llama_model_cfg(hf: dict) -> dict:
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = []
    if rope_type != "default":
        problems.append(f"RoPE scaling {rope_type!r}")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (megatronish llama uses silu)")
    if hf.get("head_dim") not in (None, hidden // heads):
        problems.append(f"head_dim={hf['head_dim']} != hidden_size / num_attention_heads")
    if problems:
        raise ValueError("this Llama model cannot be represented: " + "; ".join(problems))
    return _model_cfg(
        "llama", hf,
        num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(rope.get("rope_theta",
                                                                     hf.get("rope_theta", 1e4))),
        attention_dropout=hf.get("attention_dropout", 0.0),
        bias=bool(hf.get("attention_bias") or hf.get("mlp_bias")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )  # fmt: skip


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
        "gpt2", hf,
        num_layers=hf["n_layer"], hidden_size=hidden, num_attention_heads=hf["n_head"],
        num_query_groups=hf["n_head"], ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
        max_position_embeddings=hf["n_positions"], norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        hidden_dropout=hf.get("resid_pdrop", 0.0), attention_dropout=hf.get("attn_pdrop", 0.0),
        bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )  # fmt: skip


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

    def take_or_zeros(self, name: str, n: int) -> torch.Tensor:
        return self.take(name) if name in self.state else torch.zeros(n)

    def check_all_used(self, tied: bool) -> None:
        left = [k for k in self.state if k not in self.used and not k.endswith(IGNORED_SUFFIXES)]
        if tied:
            left = [k for k in left if k != "lm_head.weight"]
        if left:
            raise ValueError(f"HF tensors megatronish has no place for: {sorted(left)[:8]}")


def _llama_from_hf(s: _Source, cfg: dict) -> dict:
    h, f, bias = cfg["hidden_size"], cfg["ffn_hidden_size"], cfg["bias"]
    d = h // cfg["num_attention_heads"]
    out = {"embedding.word.weight": s.take("model.embed_tokens.weight")}
    for i in range(cfg["num_layers"]):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out[dst + "attn_norm.weight"] = s.take(src + "input_layernorm.weight")
        out[dst + "mlp_norm.weight"] = s.take(src + "post_attention_layernorm.weight")
        out[dst + "attn.qkv.weight"] = torch.cat([s.take(f"{attn}{p}_proj.weight") for p in "qkv"])
        out[dst + "attn.proj.weight"] = s.take(attn + "o_proj.weight")
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
    linears = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc",
               "mlp.fc2": "mlp.c_proj"}  # fmt: skip
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


def override_args(model_cfg: dict) -> list[str]:
    """The ``model.*`` command-line overrides that rebuild ``model_cfg``'s model exactly."""
    keys = ["arch", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
            "ffn_hidden_size", "seq_length", "vocab_size", "max_position_embeddings", "norm_eps",
            "bias", "tie_embeddings"]  # fmt: skip
    if model_cfg["arch"] == "llama":
        keys.insert(-2, "rope_theta")

    def fmt(v) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    return [f"model.{k}={fmt(model_cfg[k])}" for k in keys]
