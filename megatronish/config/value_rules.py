"""Rules on single values of the resolved config (ranges, finiteness, empty names) and notes
on settings that are valid but have no effect. :mod:`megatronish.config.validate` collects them
with the cross-field rules."""

from __future__ import annotations

import math
from types import SimpleNamespace

from omegaconf import DictConfig

from megatronish.config.compile_rules import compile_notes
from megatronish.config.dp_rules import data_parallel_notes
from megatronish.config.fp8_rules import fp8_notes
from megatronish.config.moe_rules import moe_notes
from megatronish.config.schema import FUNCTION_KEYS, TrainConfig

# The smallest vocabulary a tokenizer trained on the built-in corpus can have: byte fallback
# takes 259 ids (256 bytes, unk, bos, eos) and every character of the corpus one more (222 in
# the whole standard library of CPython 3.11).
MIN_STDLIB_VOCAB = 512
RESUME_WORDS = ("auto", "never")


def get(cfg: TrainConfig, dotted: str):
    """``cfg``'s value at a dotted key (``"optimizer.lr"``)."""
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def not_finite(cfg: DictConfig | SimpleNamespace, prefix: str = "") -> list[str]:
    """Every float of ``cfg`` that is nan or infinite (each passes ``<`` checks silently)."""
    errors = []
    items = vars(cfg).items() if isinstance(cfg, SimpleNamespace) else cfg.items()
    for key, value in items:
        if isinstance(value, (DictConfig, SimpleNamespace)):
            errors += not_finite(value, f"{prefix}{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            errors.append(f"{prefix}{key}={value} is not a finite number")
    return errors


def value_errors(cfg: TrainConfig) -> list[str]:
    """Single values out of range (ranges other than plain positivity)."""
    o, c, errors = cfg.optimizer, cfg.checkpoint, []
    for key in ("optimizer.beta1", "optimizer.beta2"):
        v = get(cfg, key)
        if not 0.0 <= v < 1.0:
            errors.append(f"{key}={v} must be in [0, 1) (typical: beta1 0.9, beta2 0.95-0.999)")
    if o.eps <= 0:
        errors.append(f"optimizer.eps={o.eps} must be > 0 (typical 1e-8): Adam divides by it")
    if o.weight_decay < 0:
        errors.append(f"optimizer.weight_decay={o.weight_decay} must be >= 0 (0 disables it)")
    for key in ("model.rope_theta", "model.norm_eps", "model.init_std"):
        if get(cfg, key) <= 0:
            errors.append(f"{key}={get(cfg, key)} must be > 0")
    if not str(cfg.name).strip():
        errors.append(
            f"name={cfg.name!r} is empty: every unnamed run would share outputs/; "
            "set name=<something that says what this run is>"
        )
    if not str(cfg.out_dir).strip():
        errors.append("out_dir is empty; set out_dir=<a directory> (default outputs/${name})")
    if not str(cfg.data.cache_dir).strip():
        errors.append("data.cache_dir is empty; set a directory (default ~/.cache/megatronish)")
    if c.dir is not None and not str(c.dir).strip():
        errors.append("checkpoint.dir is empty; set a directory, or null to save no checkpoints")
    if c.keep_last is not None and c.keep_last < 1:
        errors.append(
            f"checkpoint.keep_last={c.keep_last} would keep no checkpoint; use null to keep "
            "every step or N >= 1 to keep the newest N"
        )
    resume = str(c.resume)
    if resume not in RESUME_WORDS and (
        resume.lower() in (*RESUME_WORDS, "none", "null", "false", "no", "off", "true", "")
    ):
        errors.append(
            f"checkpoint.resume={resume!r} reads like a keyword, not a path: use auto (resume "
            "from checkpoint.dir's latest step), never (start from scratch) or a checkpoint path"
        )
    unknown = [k for k in c.allow_model_changes if k not in FUNCTION_KEYS]
    if unknown:
        errors.append(
            f"checkpoint.allow_model_changes has {', '.join(map(str, unknown))}: only "
            f"{', '.join(FUNCTION_KEYS)} can differ from a checkpoint (shapes never can)"
        )
    return errors


def config_notes(cfg: TrainConfig, cuda_available: bool | None = None) -> list[str]:
    """Settings that are valid but do nothing here, one line each, said once by rank 0 at
    start-up (dry runs and the planner too). ``cuda_available``: whether this machine has a
    GPU (None: unknown; then only ``trainer.device=cpu`` counts as a CPU run)."""
    notes = []
    if cfg.parallel.sp and cfg.parallel.tp == 1:
        notes.append(
            "parallel.sp=true has no effect with parallel.tp=1 (sequence parallelism splits "
            "the sequence over the tp group): the run is the same as with sp=false"
        )
    notes += data_parallel_notes(cfg, cuda_available)
    notes += moe_notes(cfg)
    notes += fp8_notes(cfg)
    notes += compile_notes(cfg)
    return notes
