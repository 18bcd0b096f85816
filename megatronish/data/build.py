"""Build the train/valid GPT datasets and tokenizer described by the ``data`` config section."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from megatronish.data.blend import BlendedDataset
from megatronish.data.gpt_dataset import GPTDataset
from megatronish.data.indexed import IndexedDataset
from megatronish.data.stdlib_corpus import ensure_stdlib_corpus
from megatronish.data.tokenizer import Tokenizer, directory_problem, load_tokenizer

if TYPE_CHECKING:
    from types import SimpleNamespace

    from megatronish.config.schema import DataConfig

    # ``data_cfg``: the config section, or an object or mapping with some of its keys
    DataSection = DataConfig | SimpleNamespace | Mapping[str, object]

DEFAULTS: dict[str, Any] = {
    "source": "stdlib",
    "prefix": None,
    "tokenizer_model": None,
    "cache_dir": "~/.cache/megatronish",
    "vocab_size": 4096,
    "max_corpus_mb": 8.0,
    "valid_fraction": 0.02,
    "blend": None,
    "blend_valid": None,
}
FULL_SCAN_TOKENS = 1 << 28  # scan every token up to this size; larger data is spot-checked
_CHUNK = 1 << 24


def _cfg(data_cfg: DataSection, key: str) -> Any:
    if isinstance(data_cfg, Mapping):
        value = data_cfg.get(key)
    else:
        value = getattr(data_cfg, key, None)
    return DEFAULTS[key] if value is None else value


def _resolve_indexed(data_cfg: DataSection) -> tuple[str, str]:
    prefix, model = _cfg(data_cfg, "prefix"), _cfg(data_cfg, "tokenizer_model")
    if not prefix:
        raise ValueError(
            "data.prefix is required when data.source=indexed: set it to the output prefix of "
            "tools/preprocess_data.py (path without .bin/.idx), or use data.source=stdlib"
        )
    return _resolve_prefix(prefix, "data.prefix"), _resolve_tokenizer(model)


def _resolve_prefix(prefix: str, key: str) -> str:
    prefix = os.path.expanduser(str(prefix))
    if prefix.endswith((".bin", ".idx")):
        prefix = prefix[:-4]
    for path in (prefix + ".idx", prefix + ".bin"):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{key}={prefix}: {path} does not exist; create it with "
                "tools/preprocess_data.py --output-prefix <prefix>, or fix the prefix"
            )
    return prefix


def _resolve_tokenizer(model: str | None) -> str:
    if not model:
        raise ValueError(
            "data.tokenizer_model is required for indexed data (data.prefix or data.blend): "
            "set it to the tokenizer tools/preprocess_data.py used (a sentencepiece .model, a "
            "Hugging Face tokenizer.json or a directory holding one)"
        )
    model = os.path.expanduser(str(model))
    if not os.path.exists(model):
        raise FileNotFoundError(
            f"data.tokenizer_model={model} does not exist; train one with "
            "tools/train_tokenizer.py, or fix data.tokenizer_model"
        )
    if os.path.isdir(model) and (problem := directory_problem(model)) is not None:
        raise FileNotFoundError(f"data.tokenizer_model={problem}")
    return model


def check_token_ids(indexed: IndexedDataset, tokenizer: Tokenizer) -> None:
    """Raise ValueError if the data holds an id outside ``[0, tokenizer.vocab_size)``.

    The dtype must be integral. Data of up to ``FULL_SCAN_TOKENS`` (256M) tokens is scanned
    fully (~0.05 s per 100M cached tokens); larger data only in its first and last 16M tokens.
    """
    if indexed.dtype.kind not in "iu":
        raise ValueError(f"{indexed.bin_path} holds {indexed.dtype} values, not token ids")
    data, n = indexed.tokens, indexed.num_tokens
    if n == 0:
        return
    ranges = [(0, n)] if n <= FULL_SCAN_TOKENS else [(0, _CHUNK), (n - _CHUNK, n)]
    lo, hi = np.iinfo(np.int64).max, -1
    for a, b in ranges:
        for s in range(a, b, _CHUNK):
            chunk = data[s : min(s + _CHUNK, b)]
            lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
    if lo < 0 or hi >= tokenizer.vocab_size:
        raise ValueError(
            f"{indexed.bin_path} contains token id {hi if hi >= tokenizer.vocab_size else lo} "
            f"but tokenizer {tokenizer.model_path} has vocab_size {tokenizer.vocab_size}: the "
            "data was made with another tokenizer. Set data.tokenizer_model to that tokenizer "
            "or rerun tools/preprocess_data.py with this one"
        )


def build_datasets(
    data_cfg: DataSection,
    seq_length: int,
    seed: int,
    samples: tuple[int, int] | None = None,
    log: Callable[[str], None] = print,
) -> tuple[Any, Any, Tokenizer]:
    """(train, valid, tokenizer) for ``data_cfg`` (object or mapping with the keys of ``DEFAULTS``;
    missing or None values take the default).

    ``source="stdlib"`` builds or reuses the cached standard-library corpus; ``"indexed"``
    reads ``prefix`` (.bin/.idx) with ``tokenizer_model``; ``blend`` (``[[weight, prefix], ...]``)
    blends indexed datasets into :class:`~megatronish.data.blend.BlendedDataset` objects of
    ``samples = (train, valid)`` global samples. Token ids are checked against the tokenizer
    vocabulary (see :func:`check_token_ids`).
    """
    valid_fraction = float(_cfg(data_cfg, "valid_fraction"))
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"data.valid_fraction={valid_fraction} must be in (0, 1)")
    if _cfg(data_cfg, "blend") is not None:
        return _build_blend(data_cfg, seq_length, seed, samples, valid_fraction, log)
    source = _cfg(data_cfg, "source")
    if source == "stdlib":
        prefix, model = ensure_stdlib_corpus(
            _cfg(data_cfg, "cache_dir"),
            int(_cfg(data_cfg, "vocab_size")),
            float(_cfg(data_cfg, "max_corpus_mb")),
        )
    elif source == "indexed":
        prefix, model = _resolve_indexed(data_cfg)
    else:
        raise ValueError(f"data.source={source!r} is unknown; use 'stdlib' or 'indexed'")
    tokenizer = load_tokenizer(model)
    indexed = IndexedDataset(prefix)
    check_token_ids(indexed, tokenizer)
    train = GPTDataset(indexed, seq_length, seed, "train", valid_fraction)
    valid = GPTDataset(indexed, seq_length, seed, "valid", valid_fraction)
    return train, valid, tokenizer


def _build_blend(
    data_cfg: DataSection,
    seq_length: int,
    seed: int,
    samples: tuple[int, int] | None,
    valid_fraction: float,
    log: Callable[[str], None],
):
    """Blended train and valid datasets (see :func:`build_datasets`)."""
    if samples is None:
        raise ValueError("a blend needs the number of (train, valid) samples to build its index")
    tokenizer = load_tokenizer(_resolve_tokenizer(_cfg(data_cfg, "tokenizer_model")))
    cache = os.path.join(os.path.expanduser(str(_cfg(data_cfg, "cache_dir"))), "blends")

    def datasets(key: str, split: str, fraction: float):
        weights, parts, names = [], [], []
        for i, (weight, prefix) in enumerate(_cfg(data_cfg, key)):
            indexed = IndexedDataset(_resolve_prefix(prefix, f"{key}[{i}]"))
            check_token_ids(indexed, tokenizer)
            weights.append(float(weight))
            parts.append(GPTDataset(indexed, seq_length, seed, split, fraction))
            names.append(os.path.basename(indexed.prefix))
        return parts, weights, names

    train_parts, weights, names = datasets("blend", "train", valid_fraction)
    train = BlendedDataset(train_parts, weights, samples[0], names, cache, log)
    if _cfg(data_cfg, "blend_valid") is not None:  # whole datasets set aside for validation
        valid_parts, valid_weights, valid_names = datasets("blend_valid", "train", 0.0)
    else:
        valid_parts, valid_weights, valid_names = datasets("blend", "valid", valid_fraction)
    valid = BlendedDataset(valid_parts, valid_weights, samples[1], valid_names, cache, log)
    return train, valid, tokenizer
