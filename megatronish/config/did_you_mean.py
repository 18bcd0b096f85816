"""The closest valid names to a mistyped one, for the "did you mean ...?" of one-line errors:
config keys (``trainer.max_step`` -> ``trainer.max_steps``), group options (``model=gpt1b``
-> ``gpt_1b``), the planner's and generate's options, the tools' flags.

Spelling distance (difflib) finds typos; names other trainers use (Megatron-LM's
``train_iters``, ``tensor_model_parallel_size``, ``learning_rate``) are found by their
initials (``tensor_parallel`` -> ``tp``) or :data:`SYNONYMS`. Importing this module is cheap:
the schema is imported only when config keys are asked for.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable

CUTOFF = 0.7  # the least difflib ratio that counts as a typo
NEAR_BEST = 0.05  # names within this of the best score are offered too
OTHER_SECTION = 0.1  # a key of another section is a less likely meaning
# Key names (the last part of a key) of Megatron-LM (flag names with _ for -) and other
# trainers, for which spelling distance finds nothing: theirs -> ours.
SYNONYMS = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "data_parallel_size": "dp",
    "sequence_parallel": "sp",
    "virtual_pipeline_model_parallel_size": "vpp",
    "train_iters": "max_steps",
    "max_iters": "max_steps",
    "steps": "max_steps",
    "lr_warmup_iters": "warmup_steps",
    "warmup_iters": "warmup_steps",
    "lr_decay_iters": "decay_steps",
    "lr_decay_style": "style",
    "clip_grad": "grad_clip",
    "max_grad_norm": "grad_clip",
    "adam_beta1": "beta1",
    "adam_beta2": "beta2",
    "adam_eps": "eps",
    "n_layer": "num_layers",
    "n_layers": "num_layers",
    "n_head": "num_attention_heads",
    "n_heads": "num_attention_heads",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_query_groups",
    "n_kv_heads": "num_query_groups",
    "num_key_value_heads": "num_query_groups",
    "kv_channels": "head_dim",
    "qk_layernorm": "qk_norm",
    "n_embd": "hidden_size",
    "d_model": "hidden_size",
    "dim": "hidden_size",
    "seq_len": "seq_length",
    "block_size": "seq_length",
    "rotary_base": "rope_theta",
    "norm_epsilon": "norm_eps",
    "layernorm_epsilon": "norm_eps",
    "init_method_std": "init_std",
    "data_path": "prefix",
    "path": "prefix",
    "save": "dir",
    "load": "resume",
    "save_interval": "interval",
    "exit_duration_in_mins": "exit_after_minutes",
    "moe_router_topk": "top_k",
    "moe_aux_loss_coeff": "aux_loss_coef",
    "moe_z_loss_coeff": "z_loss_coef",
    "moe_expert_capacity_factor": "capacity_factor",
    "moe_router_score_function": "score",
    "score_function": "score",
    "moe_router_bias_update_rate": "bias_update_rate",
    "moe_router_enable_expert_bias": "bias_update_rate",
    "moe_router_num_groups": "num_groups",
    "moe_router_group_topk": "max_groups",
    "bf16": "precision",
    "fp16": "precision",
}


def did_you_mean(names: Iterable[str]) -> str:
    """``did you mean a or b?`` for the names found (empty string for none)."""
    names = list(names)
    return f"did you mean {' or '.join(names)}?" if names else ""


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _best(scores: dict[str, float], n: int, cutoff: float = CUTOFF) -> list[str]:
    """The names scoring at least ``cutoff`` and near the best, best first, at most n."""
    ranked = sorted(((s, k) for k, s in scores.items() if s >= cutoff), key=lambda x: -x[0])
    if not ranked:
        return []
    return [name for s, name in ranked if s >= ranked[0][0] - NEAR_BEST][:n]


def closest_names(
    word: str, candidates: Iterable[str], n: int = 3, cutoff: float = CUTOFF
) -> list[str]:
    """The candidates closest in spelling to ``word`` (an option, a flag), best first."""
    return _best({c: _ratio(word.lower(), c.lower()) for c in candidates}, n, cutoff)


def schema_keys(schema: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the training config (sections too: ``model``, ``model.moe``,
    ``model.moe.router.aux_loss_coef``), in schema order."""
    if schema is None:
        from megatronish.config.schema import TrainConfig

        schema = TrainConfig
    keys = []
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        keys.append(key)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            keys += schema_keys(type(default), f"{key}.")
    return keys


def _initials(name: str) -> str:
    """``tensor_parallel`` -> ``tp`` (one word has none, nor has a name with a one-letter word:
    ``top_p`` is not ``tp``)."""
    words = [w for w in name.replace("-", "_").split("_") if w]
    if len(words) < 2 or min(len(w) for w in words) < 2:
        return ""
    return "".join(w[0] for w in words)


def _leaf_score(typed: str, valid: str) -> float:
    """How likely the key name ``valid`` is what ``typed`` meant (1: a known synonym)."""
    if valid in (SYNONYMS.get(typed), _initials(typed)):
        return 1.0
    if len(typed) >= 3 and valid.startswith(typed):
        return max(0.9, _ratio(typed, valid))  # a name cut short
    return _ratio(typed, valid)


def closest_keys(key: str, extra: Iterable[str] = (), n: int = 3) -> list[str]:
    """The valid keys a mistyped config ``key`` most likely meant, best first: the schema's
    keys and ``extra`` (an entry point's own options), by the spelling of the key's last part,
    its initials (``tensor_parallel`` -> ``tp``) or a known synonym (:data:`SYNONYMS`); a key
    of another section (``trainer.lr`` -> ``optimizer.lr``) scores a little less."""
    key = key.lstrip("+~").replace("-", "_")
    section, _, leaf = key.rpartition(".")
    scores = {}
    for valid in [*schema_keys(), *extra]:
        valid_section, _, valid_leaf = valid.rpartition(".")
        score = _leaf_score(leaf.lower(), valid_leaf)
        if valid_section != section:
            score = max(score, _ratio(key, valid)) - OTHER_SECTION
        scores[valid] = score
    return _best(scores, n)
