"""The ``data`` section's rules: one dataset (``data.prefix``), a weighted blend (``data.blend``,
``data.blend_valid``) or the built-in corpus."""

from __future__ import annotations

import os
from collections.abc import Iterable

from megatronish.config.schema import DataConfig, TrainConfig
from megatronish.config.value_rules import MIN_STDLIB_VOCAB


def blend_pairs(
    blend: Iterable[object], key: str, present: bool = True
) -> tuple[list[tuple[float, str]], list[str]]:
    """``([(weight, prefix), ...], errors)`` of a ``[[weight, prefix], ...]`` list; ``present``:
    whether each prefix's ``.idx`` must exist."""
    pairs, errors = [], []
    for i, entry in enumerate(blend):
        if isinstance(entry, str) or not hasattr(entry, "__len__") or len(entry) != 2:
            errors.append(
                f"{key}[{i}]={entry} must be a [weight, prefix] pair, e.g. "
                f"{key}=[[0.7,/data/web_text_document],[0.3,/data/code_text_document]]"
            )
            continue
        weight, prefix = entry
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            weight = float("nan")
        if not weight > 0 or weight == float("inf"):
            errors.append(f"{key}[{i}] has weight {entry[0]!r}; weights must be positive numbers")
        if present and not os.path.exists(os.path.expanduser(str(prefix)) + ".idx"):
            errors.append(
                f"{key}[{i}]: {prefix}.idx does not exist; create it with "
                "tools/preprocess_data.py or fix the prefix"
            )
        pairs.append((weight, str(prefix)))
    return pairs, errors


def _tokenizer_errors(d: DataConfig, why: str) -> list[str]:
    if not d.tokenizer_model:
        return [
            f"{why} needs data.tokenizer_model (a sentencepiece .model, a Hugging Face "
            "tokenizer.json or a directory holding one)"
        ]
    path = os.path.expanduser(d.tokenizer_model)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return [
            f"data.tokenizer_model={d.tokenizer_model} is a directory without a tokenizer.json; "
            "give a sentencepiece .model file (tools/train_tokenizer.py writes <prefix>.model) "
            "or a directory holding a Hugging Face tokenizer.json"
        ]
    if not os.path.exists(path):
        return [f"data.tokenizer_model={d.tokenizer_model} does not exist"]
    return []


def _stdlib_errors(d: DataConfig) -> list[str]:
    """The built-in corpus (no blend): its vocabulary, and keys it would ignore."""
    errors = []
    if d.prefix:
        errors.append(
            f"data.prefix={d.prefix} is ignored by data.source={d.source}, which trains on the "
            "built-in corpus; add data=indexed (with data.tokenizer_model) to train on it"
        )
    if d.tokenizer_model:
        errors.append(
            f"data.tokenizer_model={d.tokenizer_model} is ignored by data.source={d.source}, "
            "which trains its own tokenizer on the built-in corpus; add data=indexed with "
            "data.prefix to use it, or drop it"
        )
    if d.vocab_size < MIN_STDLIB_VOCAB:
        errors.append(
            f"data.vocab_size={d.vocab_size} is too small to train a tokenizer on the built-in "
            "corpus: byte fallback takes 259 ids and each of the corpus's characters one more; "
            f"use at least {MIN_STDLIB_VOCAB}"
        )
    return errors


def data_errors(cfg: TrainConfig, present: bool = True) -> list[str]:
    """Every problem of ``cfg.data``. ``present=False`` (dry runs, the planner): only whether the
    keys agree, not whether the dataset and tokenizer are given and exist."""
    d, errors = cfg.data, []
    blend, blend_valid = getattr(d, "blend", None), getattr(d, "blend_valid", None)
    if blend_valid is not None and blend is None:
        errors.append("data.blend_valid needs data.blend (the training blend)")
    if blend is not None:
        if d.prefix:
            errors.append(
                f"data.blend and data.prefix={d.prefix} are both set; give one: a single dataset "
                "is data.blend=[[1.0,PREFIX]] or data.prefix=PREFIX"
            )
        errors += blend_pairs(blend, "data.blend", present)[1]
        if not blend:
            errors.append("data.blend is empty; give [weight, prefix] pairs or null")
        if blend_valid is not None:
            errors += blend_pairs(blend_valid, "data.blend_valid", present)[1]
        if present:
            errors += _tokenizer_errors(d, "data.blend")
    elif d.source == "indexed" and present:
        if not d.prefix:
            errors.append(
                "data.source=indexed needs data.prefix (the .bin/.idx path prefix) or data.blend: "
                "this config trains on your corpus (tools/preprocess_data.py makes one from "
                "jsonl/parquet/txt, docs/data.md)"
            )
        errors += _tokenizer_errors(d, "data.source=indexed")
        if d.prefix and not os.path.exists(os.path.expanduser(d.prefix) + ".idx"):
            errors.append(
                f"data.prefix={d.prefix}: {d.prefix}.idx does not exist; create it with "
                "tools/preprocess_data.py"
            )
    elif d.source != "indexed":
        errors += _stdlib_errors(d)
    if not 0.0 < d.valid_fraction < 1.0:
        errors.append(f"data.valid_fraction={d.valid_fraction} must be in (0, 1)")
    boundary = str(d.document_boundaries).strip()
    if boundary != "eod" and not boundary.isdigit():
        errors.append(
            f"data.document_boundaries={d.document_boundaries!r}: expected eod (the "
            "tokenizer's end-of-document id) or a token id >= 0"
        )
    return errors


def boundary_errors(cfg: TrainConfig, tokenizer_vocab: int | None = None) -> list[str]:
    """``data.document_boundaries`` against the vocabulary: an id outside it never occurs, so
    no document would end and nothing would be packed. ``tokenizer_vocab``: the tokenizer's
    size once it is loaded; before, the built-in corpus's is ``data.vocab_size`` (indexed
    data's is not known yet), and ``model.vocab_size`` bounds the ids the model reads."""
    d, m = cfg.data, cfg.model
    boundary = str(d.document_boundaries).strip()
    if not boundary.isdigit():  # eod, or refused by data_errors
        return []
    sizes = []
    if tokenizer_vocab is not None:
        sizes.append((tokenizer_vocab, "the tokenizer's"))
    elif d.source != "indexed" and getattr(d, "blend", None) is None:
        sizes.append((d.vocab_size, "data.vocab_size, the tokenizer the built-in corpus trains"))
    if m.vocab_size:
        sizes.append((m.vocab_size, "model.vocab_size"))
    if not sizes:
        return []
    size, source = min(sizes)
    if int(boundary) < size:
        return []
    return [
        f"data.document_boundaries={boundary} is not an id of the vocabulary of {size} tokens "
        f"({source}; ids 0 to {size - 1}): no document would end there and nothing would be "
        "packed; use eod (the tokenizer's end-of-document id) or the id that separates the "
        "documents in the data"
    ]
