"""What megatronish and Hugging Face Llama / GPT-2 / Mixtral / Qwen3 checkpoints share: names,
vocabulary.

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

A llama mixture of experts is Mixtral (``MixtralForCausalLM``); its blocks' MLP maps as in
:mod:`megatronish.hf.mixtral`, everything else as for Llama. A llama with per-head query and key
norms (``model.qk_norm``) is Qwen3 (``Qwen3ForCausalLM``), or with experts Qwen3-MoE
(``Qwen3MoeForCausalLM``): :mod:`megatronish.hf.qwen3`.

The embedding (and head) rows beyond the real vocabulary are megatronish's padding: exports
drop them, imports add zero rows up to a multiple of 128. Both models use the rotate-half RoPE
convention and the same GQA head grouping, so q/k/v rows need no permutation. Linear biases
megatronish does not have (gpt2 with ``bias=false``) are exported as zeros; biases HF has only on
one side (llama ``attention_bias`` without ``mlp_bias``) are imported with zeros for the other.
The weight conversions work on CPU tensors in memory (no files, no transformers import);
:mod:`megatronish.hf.tokenizer_files` writes an export's tokenizer files.
"""

from __future__ import annotations

import dataclasses

import torch

from megatronish.config.schema import ModelConfig, MoEConfig, RouterConfig
from megatronish.spec import ModelSpec

VOCAB_MULTIPLE = 128
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # all the tanh approximation
# Megatronish's sentencepiece tokenizers: 0 <unk>, 1 <s>, 2 </s> (end of document), no padding.
# Exports of checkpoints that do not record their tokenizer's ids use these.
DEFAULT_SPECIAL_TOKENS = {"bos_token_id": 1, "eos_token_id": 2}
# The model.moe and model.moe.router keys an import records (and prints as overrides).
MOE_KEYS = (
    "num_experts",
    "top_k",
    "layer_freq",
    "ffn_hidden_size",
    "shared_experts",
    "capacity_factor",
)
ROUTER_KEYS = ("score", "renormalize", "aux_loss_coef", "z_loss_coef")


def _known(cls, values: dict, nested: str | None = None) -> dict:
    """The entries of ``values`` that are fields of dataclass ``cls`` (but ``nested``)."""
    names = {f.name for f in dataclasses.fields(cls)} - {nested}
    return {k: v for k, v in values.items() if k in names}


def model_config(model_cfg: dict) -> ModelConfig:
    """The :class:`ModelConfig` of a ``model`` section stored as a plain dict (nested ``moe`` and
    ``moe.router`` dicts included; unknown keys are dropped, missing ones take defaults)."""
    moe = dict(model_cfg.get("moe") or {})
    router = RouterConfig(**_known(RouterConfig, moe.get("router") or {}))
    return ModelConfig(
        **_known(ModelConfig, model_cfg, "moe"),
        moe=MoEConfig(**_known(MoEConfig, moe, "router"), router=router),
    )


def model_spec(model_cfg: dict, vocab_size: int) -> ModelSpec:
    """The resolved :class:`ModelSpec` of a ``model`` config section stored as a plain dict."""
    return ModelSpec.from_config(model_config(model_cfg), vocab_size)


def own_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous copy (safetensors refuses tensors that share memory)."""
    out = torch.empty(t.shape, dtype=dtype or t.dtype)
    return out.copy_(t)


def override_args(model_cfg: dict) -> list[str]:
    """The ``model.*`` command-line overrides that rebuild ``model_cfg``'s model exactly."""
    keys = [
        "arch",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
        "seq_length",
        "vocab_size",
        "max_position_embeddings",
        "norm_eps",
        "bias",
        "tie_embeddings",
    ]
    if model_cfg["arch"] == "llama":
        keys.insert(-2, "rope_theta")
    keys += [k for k in ("head_dim", "qk_norm") if model_cfg.get(k)]  # Qwen3, or set widths
    args = [f"model.{k}={_fmt(model_cfg[k])}" for k in keys]
    moe = model_cfg.get("moe") or {}
    if moe.get("num_experts"):
        args += [f"model.moe.{k}={_fmt(moe[k])}" for k in MOE_KEYS if k in moe]
        router = moe.get("router") or {}
        args += [f"model.moe.router.{k}={_fmt(router[k])}" for k in ROUTER_KEYS if k in router]
    return args


def _fmt(v: str | int | float | bool | None) -> str:
    """A value as Hydra's override grammar reads it back (``true``, ``null``, ``0.001``)."""
    if v is None:
        return "null"
    return str(v).lower() if isinstance(v, bool) else str(v)
