"""Compose the training config outside ``@hydra.main`` (tests, the planner, tools)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from megatronish.config.schema import register_configs

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


def parse_bool(text: str) -> bool:
    """A ``key=value`` option's boolean: ``true``/``1``/``yes`` or ``false``/``0``/``no`` (any
    case); ValueError otherwise."""
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ValueError(text)


def load_config(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    """The resolved, schema-checked config for ``overrides`` (Hydra override syntax)."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name=config_name, overrides=list(overrides or []))
    OmegaConf.resolve(cfg)
    return cfg
