"""Packed documents on the host: each sample's document lengths, each microbatch's layout.

A sample is a ``seq_length + 1`` window of the concatenated documents (:mod:`.gpt_dataset`);
the model reads its first ``s`` tokens and predicts the last ``s``. A document ends at each EOD
token (``data.document_boundaries``; the preprocessor appends one to every document), so the
window's documents are the pieces between EODs, each EOD the last token of its document, as
Megatron-LM's ``get_ltor_masks_and_position_ids`` reads them:

- ``reset_attention_mask``: input ``i`` attends to inputs ``j <= i`` of its own document
  (Megatron: the rows after an EOD at ``i`` lose columns ``0 .. i``);
- ``reset_position_ids``: input ``i``'s position is ``i`` minus its document's first index;
- ``eod_mask_loss``: inputs that are the last token of a document (an EOD) are left out of the
  loss and of the token count. Their target is the next document's first token, which nothing
  before it in the window can predict once attention stops at the boundary (Megatron:
  ``loss_mask[tokens == eod] = 0``; the loss of predicting the EOD itself is kept).

The loss is then the mean over the kept tokens of the whole global batch, across dp ranks, cp
ranks and microbatches, as one process computes it: each microbatch divides its summed loss by
:func:`loss_divisor`, which every rank computes from the global batch's document counts (read on
the host by the prefetcher: no collective, no device read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatronish.context_parallel.documents import Documents
from megatronish.context_parallel.split import split_sequence

OPTIONS = ("reset_attention_mask", "reset_position_ids", "eod_mask_loss")
# Attention on a CPU runs per segment of at least this many tokens of whole documents (see
# :func:`attention_segments`; tools/bench/packed.py measures the choice).
SEGMENT_TOKENS = 128


def document_lengths(window: np.ndarray | torch.Tensor, eod: int) -> np.ndarray:
    """Lengths of the documents of a token window (they sum to its length): each ends at an
    EOD token, inclusive, or at the window's end."""
    window = np.asarray(window)
    ends = np.flatnonzero(window == eod) + 1
    if ends.size == 0 or ends[-1] != window.size:
        ends = np.append(ends, window.size)
    return np.diff(ends, prepend=0).astype(np.int64)


def attention_segments(
    lengths: np.ndarray, seq_length: int, min_tokens: int = SEGMENT_TOKENS
) -> tuple[tuple[int, int, bool], ...]:
    """A window's inputs as runs of whole consecutive documents, ``(start, end, several)``:
    a document of ``min_tokens`` or more is a run of its own (plain causal attention); shorter
    neighbours share one (attention with their mask) until it holds ``min_tokens`` tokens. The
    runs cover ``[0, seq_length)``."""
    ends = np.minimum(np.cumsum(lengths), seq_length)
    ends = ends[np.concatenate([[True], ends[1:] != ends[:-1]])]  # the last piece may be empty
    runs: list[list[int]] = []  # [start, end, documents]
    start, open_run = 0, False  # open: the last run gathers short documents and is short
    for end in ends.tolist():
        short = end - start < min_tokens
        if short and open_run:
            runs[-1][1], runs[-1][2] = end, runs[-1][2] + 1
        else:
            runs.append([start, end, 1])
        open_run = short and runs[-1][1] - runs[-1][0] < min_tokens
        start = end
    return tuple((a, b, n > 1) for a, b, n in runs)


def kept_targets(lengths: np.ndarray, seq_length: int) -> int:
    """Targets of a ``seq_length + 1`` window with these document lengths that ``eod_mask_loss``
    keeps: all but one per document boundary inside the window."""
    return seq_length - (len(lengths) - 1)


def attention_pairs(lengths: np.ndarray, seq_length: int) -> int:
    """Query-key pairs of a window's inputs under document masks, counted as model FLOPs count
    a sequence's (``s^2``, causal half not discounted): the sum of its documents' squared
    lengths among the first ``seq_length`` tokens."""
    inputs = np.asarray(lengths, dtype=np.int64).copy()
    inputs[-1] -= 1  # the window's last token is a target only
    return int((inputs * inputs).sum())


def expected_attention_span(
    document_lengths: np.ndarray, seq_length: int, seed: int = 0, windows: int = 20_000
) -> float:
    """Mean document length per token (``sum l^2 / s`` per window, see
    :func:`attention_pairs`) of ``seq_length`` windows packed from documents of these lengths
    in a seeded random order, as :class:`~megatronish.data.gpt_dataset.GPTDataset` packs them;
    at most ``windows`` windows are cut."""
    lengths = np.random.default_rng(seed).permutation(np.asarray(document_lengths, np.int64))
    ends = np.cumsum(lengths)
    count = min(windows, int(ends[-1]) // seq_length) if ends.size else 0
    if count == 0:
        return float(seq_length)
    cuts = np.arange(1, count + 1) * seq_length
    bounds = np.union1d(ends[ends < cuts[-1]], cuts)  # every piece's end, in order
    pieces = np.diff(bounds, prepend=0)
    return float((pieces * pieces).sum() / (count * seq_length))


def loss_divisor(kept: int, dp_cp: int, microbatches: int) -> float:
    """What each microbatch's summed loss is divided by so that the grads, averaged over the
    ``dp_cp`` ranks and ``microbatches`` (loss scale ``1 / microbatches``), and the reported
    mean loss are those of the mean over the global batch's ``kept`` tokens."""
    return max(kept, 1) / (dp_cp * microbatches)


class DocumentSamples:
    """A dataset's samples with their document lengths: ``(tokens [s + 1], lengths)``."""

    def __init__(self, dataset: Any, eod: int) -> None:
        self.dataset, self.eod = dataset, eod

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, np.ndarray]:
        tokens = self.dataset[index]
        return tokens, document_lengths(tokens.numpy(), self.eod)


@dataclass(frozen=True)
class DocumentPacking:
    """Which of the packed-document options are on, and the token that ends a document."""

    eod: int
    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False

    @classmethod
    def from_config(cls, data_cfg: Any, tokenizer_eod: int | None) -> DocumentPacking | None:
        """The ``data`` section's options (None when all are off: today's unmasked training,
        unchanged). ``data.document_boundaries`` is ``eod`` (the tokenizer's end-of-document
        id, ``tokenizer_eod``) or a token id."""

        def get(key: str) -> Any:
            if isinstance(data_cfg, Mapping):
                return data_cfg.get(key)
            return getattr(data_cfg, key, None)

        flags = {key: bool(get(key)) for key in OPTIONS}
        if not any(flags.values()):
            return None
        eod = boundary_token(get("document_boundaries"), tokenizer_eod)
        return cls(eod=eod, **flags)

    def samples(self, dataset: Any) -> DocumentSamples:
        """``dataset``'s samples with their document lengths."""
        return DocumentSamples(dataset, self.eod)

    def microbatch(
        self,
        samples: Sequence[tuple[torch.Tensor, np.ndarray]],
        cp: int,
        cp_rank: int,
        divisor: float | None,
    ) -> Documents:
        """The host :class:`Documents` of a microbatch of ``(tokens, lengths)`` samples, cut to
        cp rank ``cp_rank``'s chunks. ``divisor``: see :func:`loss_divisor`."""
        s = samples[0][0].shape[0] - 1
        ids = np.stack([np.repeat(np.arange(len(n)), n) for _, n in samples])  # [b, s + 1]
        out = Documents()
        if self.reset_attention_mask:
            out.ids = torch.from_numpy(ids[:, :s]).contiguous()
            out.segments = tuple(attention_segments(n, s) for _, n in samples)
        if self.reset_position_ids:
            starts = np.stack([np.repeat(np.cumsum(n) - n, n) for _, n in samples])
            positions = torch.from_numpy(np.arange(s + 1) - starts)[:, :s]
            out.positions = split_sequence(positions, 1, cp, cp_rank).contiguous()
        if self.eod_mask_loss:
            keep = torch.from_numpy(ids[:, 1:] == ids[:, :-1]).float()
            out.loss_weights = split_sequence(keep, 1, cp, cp_rank).contiguous()
            out.loss_divisor = divisor
        return out


def boundary_token(value: Any, tokenizer_eod: int | None) -> int:
    """The token id ``data.document_boundaries`` names: ``eod`` (or unset) for the tokenizer's
    end-of-document id, else an id."""
    if value is None or value == "eod":
        if tokenizer_eod is None or tokenizer_eod < 0:
            raise ValueError(
                "data.document_boundaries=eod but the tokenizer has no end-of-document id; set "
                "data.document_boundaries to the id that separates documents in the data"
            )
        return int(tokenizer_eod)
    try:
        token = int(value)
    except (TypeError, ValueError):
        token = -1
    if token < 0 or str(value).strip() != str(token):
        raise ValueError(
            f"data.document_boundaries={value!r}: expected eod (the tokenizer's end-of-document "
            "id) or a token id >= 0"
        )
    return token
