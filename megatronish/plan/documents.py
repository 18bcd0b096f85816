"""The attention work the plan counts for packed documents (``data.reset_attention_mask``).

With document masks a token attends within its document only, so the attention FLOPs of a
window are the sum of its documents' squared lengths, not ``s^2``
(:mod:`megatronish.model.flops`). The plan reads the document lengths of the configured data
(its ``.idx``: ``data.prefix``, each ``data.blend`` entry weighted, or the built-in corpus once
built) and packs them into windows as the dataset does
(:func:`~megatronish.data.documents.expected_attention_span`). Where the data is not at hand the
plan counts whole windows and says so.
"""

from __future__ import annotations

import functools
import os

from megatronish.config.schema import TrainConfig
from megatronish.data.documents import expected_attention_span
from megatronish.data.indexed import IndexedDataset
from megatronish.data.stdlib_corpus import DATA_NAME, MARKER, stdlib_cache_name


def data_prefixes(cfg: TrainConfig) -> list[tuple[float, str]] | None:
    """``[(weight, .bin/.idx prefix), ...]`` of the configured data, None when one is missing."""
    d = cfg.data
    if d.blend is not None:
        pairs = [(float(w), os.path.expanduser(str(p))) for w, p in d.blend]
    elif d.source == "indexed" and d.prefix:
        pairs = [(1.0, os.path.expanduser(d.prefix))]
    else:
        folder = os.path.join(
            os.path.expanduser(d.cache_dir), stdlib_cache_name(d.vocab_size, d.max_corpus_mb)
        )
        if not os.path.isfile(os.path.join(folder, MARKER)):
            return None
        pairs = [(1.0, os.path.join(folder, DATA_NAME))]
    if not all(os.path.isfile(p + ".idx") for _, p in pairs):
        return None
    return pairs


@functools.lru_cache(maxsize=16)
def _span_of(prefix: str, modified: float, seq_length: int) -> float:
    """:func:`expected_attention_span` of one dataset (cached per file version)."""
    _, lengths = IndexedDataset(prefix).document_spans()
    return expected_attention_span(lengths, seq_length)


def planned_attention_span(cfg: TrainConfig) -> float | None:
    """The mean document length per token the plan counts attention over: None without
    document masks, or when the data's document lengths cannot be read yet."""
    if not cfg.data.reset_attention_mask:
        return None
    pairs = data_prefixes(cfg)
    if pairs is None:
        return None
    s = cfg.model.seq_length
    total = sum(w for w, _ in pairs)
    spans = [w * _span_of(p, os.path.getmtime(p + ".idx"), s) for w, p in pairs]
    return sum(spans) / total
