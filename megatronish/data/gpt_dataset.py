"""GPT pretraining samples: packed, shuffled ``seq_length + 1`` token windows over documents.

Documents are split into train/valid by a seeded permutation. For epoch ``e`` the split's
documents are shuffled with seed ``(seed, split, e)`` and conceptually concatenated into one
stream of ``T`` tokens; sample ``j`` of the epoch is stream tokens ``[j*s, j*s + s + 1)`` (``s``
= seq_length), so neighbouring windows share one token and there are ``(T - 1) // s`` samples.
The order of the samples inside the epoch is a second seeded permutation.

Global sample ``g`` lives in epoch ``g // samples_per_epoch``. The mapping from ``g`` to tokens
depends only on (data, seq_length, seed, split), never on who asks, so a data-parallel rank
reads global samples ``step * global_batch + k`` and resuming at any step, with any dp size
or worker count, is an O(1) jump.
"""

from __future__ import annotations

import operator
from collections import OrderedDict

import numpy as np
import torch

from megatronish.data.indexed import IndexedDataset

_SPLITS = {"train": 0, "valid": 1}
_SPLIT_STREAM = 0x5917  # rng stream id for the train/valid document split
_EPOCH_STREAM = 0xE90C  # rng stream id for per-epoch document and sample orders


def split_documents(
    num_docs: int, seed: int, valid_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, valid) document ids from a seeded permutation of ``range(num_docs)``.

    Valid gets ``round(valid_fraction * num_docs)`` documents, at least one when there are two
    or more documents and ``valid_fraction > 0``, and never all of them.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction={valid_fraction} must be in [0, 1)")
    n_valid = round(valid_fraction * num_docs)
    if valid_fraction > 0 and num_docs >= 2:
        n_valid = min(max(n_valid, 1), num_docs - 1)
    perm = np.random.default_rng([_SPLIT_STREAM, seed]).permutation(num_docs)
    return np.sort(perm[n_valid:]), np.sort(perm[:n_valid])


class _Epoch:
    """Per-epoch lookup tables: shuffled documents and shuffled sample positions."""

    def __init__(self, starts: np.ndarray, lengths: np.ndarray, samples: np.ndarray) -> None:
        self.starts = starts  # .bin token position of each document, in stream order
        self.cum = np.zeros(lengths.size + 1, dtype=np.int64)  # stream offset of each document
        np.cumsum(lengths, out=self.cum[1:])
        self.samples = samples  # permutation of the epoch's sample positions


class GPTDataset(torch.utils.data.Dataset):
    """Infinite deterministic stream of ``[seq_length + 1]`` LongTensor samples of one split.

    ``len()`` is ``samples_per_epoch``, but any non-negative index is valid: index ``g`` reads
    sample ``g % samples_per_epoch`` of epoch ``g // samples_per_epoch``. Per-epoch tables are
    built lazily (O(documents + samples_per_epoch)); the two most recent epochs are cached.
    """

    cached_epochs = 2

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_length: int,
        seed: int,
        split: str = "train",
        valid_fraction: float = 0.02,
    ) -> None:
        if split not in _SPLITS:
            raise ValueError(f"split={split!r}: expected one of {sorted(_SPLITS)}")
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be >= 1")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        self.indexed = indexed
        self.seq_length = seq_length
        self.seed = seed
        self.split = split
        self._doc_starts, self._doc_lengths = indexed.document_spans()
        train, valid = split_documents(len(self._doc_lengths), seed, valid_fraction)
        self.documents = train if split == "train" else valid
        self.num_tokens = int(self._doc_lengths[self.documents].sum())
        if self.num_tokens < seq_length + 1:
            raise ValueError(
                f"the {split} split of {indexed.prefix} has {self.num_tokens} tokens in "
                f"{self.documents.size} documents (valid_fraction={valid_fraction}), fewer than "
                f"seq_length + 1 = {seq_length + 1}; use more data, a smaller seq_length"
                + (" or a larger valid_fraction" if split == "valid" else "")
            )
        self.samples_per_epoch = (self.num_tokens - 1) // seq_length
        self._epochs: OrderedDict[int, _Epoch] = OrderedDict()

    def __len__(self) -> int:
        return self.samples_per_epoch

    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([_EPOCH_STREAM, self.seed, _SPLITS[self.split], epoch])

    def document_order(self, epoch: int) -> np.ndarray:
        """Document ids of this split in the order they are concatenated in ``epoch``."""
        return self._rng(epoch).permutation(self.documents)

    def sample_order(self, epoch: int) -> np.ndarray:
        """Stream position ``j`` (window ``[j*s, j*s+s+1)``) of each sample of ``epoch``."""
        return self._epoch(epoch).samples

    def _epoch(self, epoch: int) -> _Epoch:
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
            return self._epochs[epoch]
        rng = self._rng(epoch)
        order = rng.permutation(self.documents)  # same draw as document_order(epoch)
        table = _Epoch(
            self._doc_starts[order],
            self._doc_lengths[order],
            rng.permutation(self.samples_per_epoch),
        )
        self._epochs[epoch] = table
        while len(self._epochs) > self.cached_epochs:
            self._epochs.popitem(last=False)
        return table

    def tokens(self, index: int) -> np.ndarray:
        """Sample ``index`` as a numpy array in the .bin dtype."""
        index = operator.index(index)
        if index < 0:
            raise IndexError(f"sample index {index} must be >= 0")
        epoch, local = divmod(index, self.samples_per_epoch)
        table = self._epoch(epoch)
        begin = int(table.samples[local]) * self.seq_length
        end = begin + self.seq_length + 1
        first = int(np.searchsorted(table.cum, begin, side="right")) - 1
        last = int(np.searchsorted(table.cum, end - 1, side="right")) - 1
        data = self.indexed.tokens
        pieces = []
        for k in range(first, last + 1):
            lo = max(begin, int(table.cum[k])) - int(table.cum[k])
            hi = min(end, int(table.cum[k + 1])) - int(table.cum[k])
            start = int(table.starts[k])
            pieces.append(data[start + lo : start + hi])
        return np.concatenate(pieces) if len(pieces) > 1 else np.array(pieces[0])

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.tokens(index).astype(np.int64))


def get_batch(dataset: GPTDataset, start: int, count: int) -> torch.Tensor:
    """Global samples ``start .. start + count - 1`` as a ``[count, seq_length + 1]`` LongTensor."""
    rows = [dataset.tokens(start + i) for i in range(count)]
    if not rows:
        return torch.zeros(0, dataset.seq_length + 1, dtype=torch.long)
    return torch.from_numpy(np.stack(rows).astype(np.int64))
