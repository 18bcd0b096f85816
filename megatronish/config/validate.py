"""Cross-field rules checked on the resolved config before any process group exists.

:func:`config_errors` is pure: it returns every violated rule at once, each a sentence naming
the values and the fix. :func:`check_config` raises :class:`ConfigError` with all of them.
"""

from __future__ import annotations

import functools

from omegaconf import DictConfig, OmegaConf

from megatronish.config.cli_errors import unknown_key_reason
from megatronish.config.compile_rules import compile_errors
from megatronish.config.cp_rules import cp_exchange_errors
from megatronish.config.data_rules import boundary_errors, data_errors
from megatronish.config.derived import default_ffn_hidden, pad_vocab
from megatronish.config.dp_rules import data_parallel_errors
from megatronish.config.fp8_rules import fp8_errors
from megatronish.config.moe_rules import moe_errors
from megatronish.config.pipeline_rules import (
    PIPELINE_SCHEDULES,
    pipeline_schedule_error,
    resolve_pipeline_schedule,
)
from megatronish.config.schema import TrainConfig
from megatronish.config.value_rules import get, not_finite, value_errors

CHOICES = {
    "model.arch": ("llama", "gpt2"),
    "trainer.precision": ("fp32", "bf16"),
    "parallel.grad_reduce_dtype": ("fp32", "bf16"),
    "trainer.recompute": ("none", "selective", "full"),
    "trainer.recompute_method": ("uniform", "block"),
    "trainer.compile_backend": ("inductor", "aot_eager"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "scheduler.style": ("cosine", "linear", "constant"),
    "optimizer.name": ("adamw",),
    "data.source": ("stdlib", "indexed"),
    "logging.timers": ("cheap", "detailed"),
    "parallel.cp_comm_type": ("all_gather", "a2a", "ring", "a2a_ring"),
}
NULLABLE_CHOICES = {
    "logging.wandb_mode": ("online", "offline", "disabled"),
    "parallel.grad_compression": ("powersgd", "int8"),
    "trainer.fp8": ("tensorwise", "rowwise"),
}


class ConfigError(ValueError):
    """The resolved config breaks one or more rules; ``errors`` lists them all."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        if len(self.errors) == 1:  # one problem, one line
            super().__init__(f"invalid config: {self.errors[0]}")
            return
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid config ({len(self.errors)} problem(s)):\n{lines}")


def unknown_keys(cfg: TrainConfig) -> list[str]:
    """Dotted keys of ``cfg`` missing from the schema (Hydra's ``+key=value`` can add them)."""
    if not isinstance(cfg, DictConfig):
        return []
    return _extra_keys(cfg, _schema_keys(), "")


@functools.cache
def _schema_keys() -> dict[str, dict | None]:
    """The schema's keys as a tree (a section: its keys; a value: None). Built once: the
    structured config takes ~0.1 s to build, and every config is checked against it."""
    return _key_tree(OmegaConf.structured(TrainConfig))


def _key_tree(node: DictConfig) -> dict[str, dict | None]:
    return {
        key: _key_tree(value) if isinstance(value, DictConfig) else None
        for key, value in node.items_ex(resolve=False)
    }


def _extra_keys(node: DictConfig, known: dict[str, dict | None], prefix: str) -> list[str]:
    extra = []
    for key, value in node.items_ex(resolve=False):
        if key not in known:
            extra.append(f"{prefix}{key}")
        elif isinstance(value, DictConfig) and known[key] is not None:
            extra += _extra_keys(value, known[key], f"{prefix}{key}.")
    return extra


def _positive(
    cfg: TrainConfig, keys: list[str], errors: list[str], allow_zero: bool = False
) -> None:
    for key in keys:
        v = get(cfg, key)
        if v is None:
            continue
        if v < 0 or (v == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else ">= 1" if isinstance(v, int) else "> 0"
            errors.append(f"{key}={v} must be {bound}")


def config_errors(
    cfg: TrainConfig,
    world_size: int,
    vocab_size: int | None = None,
    cuda_available: bool | None = None,
    data: bool = True,
) -> list[str]:
    """Every rule ``cfg`` breaks for a job of ``world_size`` ranks (empty list: valid).

    ``vocab_size`` is the tokenizer's vocabulary when known (checked against tp and the model);
    ``cuda_available`` whether this machine has a GPU (None: not checked, e.g. dry runs);
    ``data=False`` (dry runs, the planner): the data keys must agree, but the dataset and
    tokenizer need not be given or exist, and the directories the run writes
    (``trainer.compile_cache_dir``) are not looked at.
    """
    errors: list[str] = [unknown_key_reason(key) for key in unknown_keys(cfg)]
    m, p, t, o, s = cfg.model, cfg.parallel, cfg.trainer, cfg.optimizer, cfg.scheduler

    for key, allowed in CHOICES.items():
        v = get(cfg, key)
        if v not in allowed:
            errors.append(f"{key}={v!r} is not one of {', '.join(allowed)}")
    if cfg.trainer.device == "cuda" and cuda_available is False:
        errors.append(
            "trainer.device=cuda but this machine has no CUDA device (torch sees none); "
            "use trainer.device=cpu or auto, or run where a GPU is visible"
        )
    for key, allowed in NULLABLE_CHOICES.items():
        v = get(cfg, key)
        if v is not None and v not in allowed:
            errors.append(f"{key}={v!r} is not one of {', '.join(allowed)} (or null)")

    _positive(
        cfg,
        [
            "parallel.tp",
            "parallel.cp",
            "parallel.pp",
            "parallel.vpp",
            "parallel.dp",
            "trainer.num_threads",
            "trainer.peak_tflops",
            "data.max_corpus_mb",
            "data.vocab_size",
            "model.num_layers",
            "model.hidden_size",
            "model.num_attention_heads",
            "model.num_query_groups",
            "model.head_dim",
            "model.ffn_hidden_size",
            "model.seq_length",
            "model.vocab_size",
            "model.make_vocab_size_divisible_by",
            "trainer.micro_batch_size",
            "trainer.global_batch_size",
            "logging.log_interval",
            "trainer.recompute_num_layers",
            "parallel.bucket_size_mb",
            "parallel.collective_timeout_s",
            "parallel.zero_shard_size",
            "parallel.powersgd_rank",
        ],
        errors,
    )
    _positive(
        cfg,
        [
            "trainer.max_steps",
            "trainer.eval_interval",
            "trainer.eval_iters",
            "checkpoint.interval",
            "scheduler.warmup_steps",
            "trainer.max_skipped_steps",
            "trainer.seed",
            "parallel.grad_compression_start_step",
        ],
        errors,
        allow_zero=True,
    )
    errors += not_finite(cfg)
    errors += value_errors(cfg)
    if world_size < 1:
        errors.append(f"world size {world_size} must be >= 1")
    if errors:  # the divisibility rules below assume positive sizes
        return errors

    # Layout.
    model_ranks = p.tp * p.cp * p.pp  # ranks of one data-parallel replica
    names, sizes = (
        ("tp*cp*pp", f"{p.tp}*{p.cp}*{p.pp}") if p.cp > 1 else ("tp*pp", f"{p.tp}*{p.pp}")
    )
    if world_size % model_ranks:
        errors.append(
            f"world size {world_size} is not divisible by {names} = {sizes}; launch a multiple "
            f"of {model_ranks} ranks or change parallel.tp / parallel.cp / parallel.pp"
        )
        dp = 1
    elif p.dp is not None and model_ranks * p.dp != world_size:
        errors.append(
            f"{names}*dp = {sizes}*{p.dp} = {model_ranks * p.dp} but the world has "
            f"{world_size} ranks; set parallel.dp={world_size // model_ranks} or null"
        )
        dp = p.dp
    else:
        dp = p.dp if p.dp is not None else world_size // model_ranks
    if p.zero_stage not in (0, 1, 2, 3):
        errors.append(f"parallel.zero_stage={p.zero_stage} must be 0, 1, 2 or 3")
    if p.vpp > 1 and p.pp == 1:
        errors.append(f"parallel.vpp={p.vpp} needs parallel.pp > 1 (interleaving splits stages)")
    schedule = p.pipeline_schedule
    if schedule is not None and schedule not in PIPELINE_SCHEDULES:
        errors.append(
            f"parallel.pipeline_schedule={schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}"
            " (or null)"
        )
        schedule = None
    elif schedule is not None and p.pp == 1:
        errors.append(
            f"parallel.pipeline_schedule={schedule} needs parallel.pp > 1 (one stage has no "
            "pipeline to schedule); set it to null"
        )
        schedule = None
    schedule = resolve_pipeline_schedule(schedule, p.vpp)
    if p.pp > 1 and (error := pipeline_schedule_error(schedule, p.pp, p.vpp, p.pp)):
        errors.append(error)  # the chunks per stage it needs (the microbatches: below)
    errors += fp8_errors(cfg, schedule if p.pp > 1 else None)
    if p.grad_reduce_dtype == "bf16" and cfg.trainer.precision != "bf16":
        errors.append(
            "parallel.grad_reduce_dtype=bf16 needs trainer.precision=bf16 (fp32 training "
            "reduces its fp32 grads); set parallel.grad_reduce_dtype=fp32"
        )

    # Model shape against tp.
    heads, kv = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    if m.head_dim is None and m.hidden_size % heads:
        errors.append(
            f"model.hidden_size={m.hidden_size} is not divisible by "
            f"model.num_attention_heads={heads}; set model.head_dim to give each head its width"
        )
    elif m.arch == "llama" and (m.head_dim or m.hidden_size // heads) % 2:
        errors.append(
            f"head dim {m.head_dim or m.hidden_size // heads} must be even for rotary embeddings"
        )
    if heads % p.tp:
        errors.append(f"model.num_attention_heads={heads} is not divisible by parallel.tp={p.tp}")
    if heads % kv:
        errors.append(f"model.num_query_groups={kv} must divide model.num_attention_heads={heads}")
    if kv % p.tp and p.tp % kv:  # fewer kv heads than tp: each on tp / kv ranks
        errors.append(
            f"model.num_query_groups={kv} (kv heads) and parallel.tp={p.tp}: one must divide "
            f"the other (kv heads split over tp ranks, or each replicated on tp / kv ranks); "
            f"use a tp that divides {kv} or a multiple of it"
        )
    ffn = m.ffn_hidden_size or default_ffn_hidden(m.arch, m.hidden_size)
    if ffn % p.tp:
        errors.append(f"ffn hidden size {ffn} is not divisible by parallel.tp={p.tp}")
    if p.cp > 1 and m.seq_length % (2 * p.cp):
        errors.append(
            f"model.seq_length={m.seq_length} is not divisible by 2*cp = {2 * p.cp}: context "
            "parallelism gives each cp rank two equal chunks of every sequence; change "
            "model.seq_length or parallel.cp"
        )
    elif p.sp and (m.seq_length // p.cp) % p.tp:
        local = (
            f"model.seq_length/cp = {m.seq_length // p.cp}"
            if p.cp > 1
            else (f"model.seq_length={m.seq_length}")
        )
        errors.append(
            f"{local} is not divisible by parallel.tp={p.tp}, "
            "which sequence parallelism (parallel.sp=true) needs"
        )
    errors += cp_exchange_errors(cfg)
    errors += vocab_errors(cfg, vocab_size)
    errors += moe_errors(cfg, dp)
    errors += data_parallel_errors(cfg, dp)
    if m.max_position_embeddings is not None and m.seq_length > m.max_position_embeddings:
        errors.append(
            f"model.seq_length={m.seq_length} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}; raise it or set it to null (= seq_length)"
        )
    for key in ("model.hidden_dropout", "model.attention_dropout"):
        if not 0.0 <= get(cfg, key) < 1.0:
            errors.append(f"{key}={get(cfg, key)} must be in [0, 1)")

    # Pipeline split.
    chunks = p.pp * p.vpp
    if p.pipeline_layer_split is not None:
        split = list(p.pipeline_layer_split)
        if len(split) != chunks or sum(split) != m.num_layers or min(split) < 1:
            errors.append(
                f"parallel.pipeline_layer_split={split} must have pp*vpp = {chunks} entries, "
                f"each >= 1, summing to model.num_layers={m.num_layers}"
            )
    elif m.num_layers % chunks:
        errors.append(
            f"model.num_layers={m.num_layers} is not divisible by pp*vpp = {p.pp}*{p.vpp}; "
            "change the layer count, pp or vpp, or give parallel.pipeline_layer_split"
        )

    # Batch.
    mbs, gbs = t.micro_batch_size, t.global_batch_size
    if gbs % (mbs * dp):
        errors.append(
            f"trainer.global_batch_size={gbs} is not divisible by micro_batch_size*dp = "
            f"{mbs}*{dp} = {mbs * dp}; use a multiple of {mbs * dp}"
        )
    else:
        micro = gbs // (mbs * dp)
        if p.pp > 1 and micro < p.pp:
            errors.append(
                f"{micro} microbatch(es) per step is fewer than parallel.pp={p.pp}; raise "
                f"trainer.global_batch_size to at least {p.pp * mbs * dp}"
            )
        elif p.pp > 1 and (error := pipeline_schedule_error(schedule, p.pp, p.vpp, micro)):
            if error not in errors:
                errors.append(error)

    # Optimisation.
    if o.lr <= 0:
        errors.append(f"optimizer.lr={o.lr} must be > 0")
    if o.lr > 0 and (s.min_lr < 0 or s.min_lr > o.lr):
        errors.append(f"scheduler.min_lr={s.min_lr} must be in [0, optimizer.lr={o.lr}]")
    if o.grad_clip < 0:
        errors.append(f"optimizer.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping)")
    if s.decay_steps is not None and s.decay_steps < 1:
        errors.append(f"scheduler.decay_steps={s.decay_steps} must be >= 1 or null")
    elif s.decay_steps is not None and s.warmup_steps > s.decay_steps:
        errors.append(
            f"scheduler.warmup_steps={s.warmup_steps} exceeds scheduler.decay_steps="
            f"{s.decay_steps}; lower the warm-up or raise the decay length"
        )
    if o.lr > 0 and o.weight_decay >= 0 and o.lr * o.weight_decay >= 1:
        errors.append(
            f"optimizer.lr*weight_decay = {o.lr}*{o.weight_decay} >= 1: every step would "
            "scale the weights by 1 - lr*weight_decay <= 0; typical weight_decay is 0.01-0.1"
        )
    if t.eval_interval and t.eval_iters == 0:
        errors.append(
            f"trainer.eval_iters=0 with trainer.eval_interval={t.eval_interval}: evaluation "
            "would average no batches; set eval_iters >= 1 or eval_interval=0 (no evaluation)"
        )

    # Profiling.
    steps = t.profile.steps
    if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        errors.append(
            f"trainer.profile.steps={list(steps)} must be [first, last] with "
            "1 <= first <= last, e.g. trainer.profile.steps=[5,7]"
        )
    elif steps is not None and steps[0] > t.max_steps:
        errors.append(
            f"trainer.profile.steps={list(steps)} starts after trainer.max_steps={t.max_steps}: "
            "nothing would be traced; profile steps within the run"
        )

    errors += data_errors(cfg, present=data)  # dry runs and the planner need no dataset
    errors += compile_errors(cfg, present=data)  # nor the directories the run writes
    return errors


def vocab_errors(cfg: TrainConfig, vocab_size: int | None) -> list[str]:
    """The rules that need the vocabulary: ``model.vocab_size``, or the tokenizer's
    ``vocab_size`` once it is loaded (the rest of :func:`config_errors` does not)."""
    m, tp = cfg.model, cfg.parallel.tp
    errors = []
    vocab = m.vocab_size or vocab_size
    if vocab is not None and pad_vocab(vocab, m.make_vocab_size_divisible_by) % tp:
        errors.append(
            f"padded vocab {pad_vocab(vocab, m.make_vocab_size_divisible_by)} is not divisible "
            f"by parallel.tp={tp}; set model.make_vocab_size_divisible_by to a multiple of tp"
        )
    if m.vocab_size is not None and vocab_size is not None and vocab_size > m.vocab_size:
        errors.append(
            f"the tokenizer has {vocab_size} tokens but model.vocab_size={m.vocab_size}; "
            "set model.vocab_size=null to take the tokenizer's"
        )
    return errors + boundary_errors(cfg, vocab_size)


def check_config(cfg: TrainConfig, world_size: int, vocab_size: int | None = None) -> None:
    """Raise :class:`ConfigError` listing every violated rule."""
    errors = config_errors(cfg, world_size, vocab_size)
    if errors:
        raise ConfigError(errors)
