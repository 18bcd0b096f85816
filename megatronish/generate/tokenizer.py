"""The tokenizer a checkpoint's run trained with, found from its resolved ``data`` config."""

from __future__ import annotations

import os

from megatronish.data.build import DEFAULTS
from megatronish.data.stdlib_corpus import TOKENIZER_NAME, stdlib_cache_name
from megatronish.data.tokenizer import Tokenizer


def run_tokenizer_path(config: dict) -> str | None:
    """The sentencepiece model of the run with resolved ``config``: ``data.tokenizer_model``
    for indexed data (a prefix or a blend), the built-in corpus's cached tokenizer for
    ``data.source=stdlib`` (cached per Python version, vocabulary and corpus size); None when
    the config names none."""
    data = {**DEFAULTS, **{k: v for k, v in (config.get("data") or {}).items() if v is not None}}
    if data["source"] == "indexed" or data["blend"] is not None:
        return os.path.expanduser(data["tokenizer_model"]) if data["tokenizer_model"] else None
    if data["source"] != "stdlib":
        return None
    name = stdlib_cache_name(int(data["vocab_size"]), float(data["max_corpus_mb"]))
    return os.path.join(os.path.expanduser(data["cache_dir"]), name, TOKENIZER_NAME + ".model")


def load_tokenizer(config: dict, override: str | None = None) -> Tokenizer:
    """``override`` (``tokenizer_model=PATH``) or the run's tokenizer; FileNotFoundError with
    what to do when it cannot be found."""
    if override:
        return Tokenizer(override)
    path = run_tokenizer_path(config)
    if path is None:
        raise FileNotFoundError(
            "the checkpoint's config names no tokenizer; pass tokenizer_model=PATH"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"the run's tokenizer {path} (from the checkpoint's data config) does not exist; "
            "pass tokenizer_model=PATH"
        )
    return Tokenizer(path)
