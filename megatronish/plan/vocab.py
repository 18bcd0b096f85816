"""The vocabulary the planner plans with, and where it comes from.

``model.vocab_size`` when it is set; else the tokenizer's size: indexed data
(``data.source=indexed`` or ``data.blend``) reads ``data.tokenizer_model``, the built-in corpus
trains a tokenizer of ``data.vocab_size`` pieces. The planner reads no data: before indexed
data's tokenizer exists it assumes ``data.vocab_size``, and says so (the schema's default is
the built-in corpus's 4096, rarely a real corpus's vocabulary).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatronish.config.derived import pad_vocab
from megatronish.config.schema import DataConfig, TrainConfig


class VocabError(ValueError):
    """A tokenizer file that exists but cannot be read (one line naming the fix)."""


@dataclass(frozen=True)
class PlannedVocab:
    """The vocabulary a plan uses."""

    size: int  # real tokens
    padded: int  # rows of the embedding and head
    multiple: int  # model.make_vocab_size_divisible_by
    source: str  # where ``size`` comes from, in words
    tokenizer: int | None = None  # the tokenizer's pieces, when one was read

    def line(self) -> str:
        """E.g. ``vocab: 32000 (model.vocab_size), padded to 32000 (a multiple of 128)``."""
        return (
            f"vocab: {self.size} ({self.source}), padded to {self.padded} (a multiple of "
            f"{self.multiple}, model.make_vocab_size_divisible_by)"
        )


def reads_indexed_data(data) -> bool:
    """Whether the trainer takes its tokens (and tokenizer) from indexed files."""
    return data.source == "indexed" or getattr(data, "blend", None) is not None


def _tokenizer_size(path: str) -> int:
    from megatronish.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path).vocab_size
    except (OSError, ValueError) as e:
        raise VocabError(f"{e}; or give model.vocab_size=N to plan without it") from None


def _assumed(data, path: str | None) -> str:
    """Words for ``data.vocab_size`` standing in for indexed data's tokenizer."""
    why = f"data.tokenizer_model={path} does not exist yet" if path else "no data.tokenizer_model"
    default = data.vocab_size == DataConfig.vocab_size
    hint = ", the built-in corpus's default: set your tokenizer's size" if default else ""
    return f"data.vocab_size assumed, {why}{hint}"


def planned_vocab(cfg: TrainConfig) -> PlannedVocab:
    """The vocabulary of ``cfg``'s model (see the module docstring); raises :class:`VocabError`
    for a tokenizer file that cannot be read."""
    m, data = cfg.model, cfg.data
    indexed = reads_indexed_data(data)
    path = data.tokenizer_model if indexed else None
    tokenizer = None
    if path and os.path.exists(os.path.expanduser(path)):  # a file or a directory
        tokenizer = _tokenizer_size(path)
    if m.vocab_size:
        size, source = m.vocab_size, "model.vocab_size"
    elif tokenizer is not None:
        size, source = tokenizer, f"the tokenizer data.tokenizer_model={path}"
    elif indexed:
        size, source = data.vocab_size, _assumed(data, path)
    else:
        size, source = data.vocab_size, "data.vocab_size, the tokenizer the built-in corpus trains"
    multiple = m.make_vocab_size_divisible_by
    padded = pad_vocab(size, multiple) if multiple >= 1 else size  # (< 1: the rules refuse it)
    return PlannedVocab(size, padded, multiple, source, tokenizer)
