"""Weighted blends of GPT datasets with Megatron-LM's semantics.

Global sample ``g`` of a blend is sample ``dataset_sample_index[g]`` of dataset
``dataset_index[g]``. The index is Megatron's greedy error-minimising order: sample ``g`` goes to
the dataset furthest behind its share, ``argmax_d (w_d * max(g, 1) - taken_d)`` (ties to the
lower index), so every prefix of the stream matches the weights to within one sample per dataset.
It depends only on the normalised weights and the number of samples, never on who reads it: the
global-sample cursor, resume at any dp size and the samples of a step are as for one dataset.

The index is built once and cached as two ``.npy`` files (no pickle) named by a hash of what
determines it, with the CRC32 of each in a ``-crc32.json`` file written after them. A cache file
that does not match its CRC32 (a flipped byte, an edited entry) or cannot be read is rebuilt,
with one logged line naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from array import array
from collections.abc import Callable
from typing import BinaryIO

import numpy as np
import torch

BLEND_VERSION = 1  # part of the cache key: bump when the algorithm changes


def normalised(weights: list[float]) -> list[float]:
    """``weights`` scaled to sum to 1 (each must be positive and finite)."""
    if not weights:
        raise ValueError("a blend needs at least one dataset")
    for w in weights:
        if not (w > 0 and w != float("inf")):
            raise ValueError(f"blend weight {w} must be positive and finite")
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def blend_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)`` of the first ``size`` samples (Megatron's
    ``build_blending_indices``: greedy, largest error first)."""
    w = normalised(weights)
    taken = [0] * len(w)
    datasets, samples = array("h"), array("q")
    others = range(1, len(w))
    for g in range(size):
        t = g if g > 1 else 1
        best, best_error = 0, w[0] * t - taken[0]
        for d in others:
            error = w[d] * t - taken[d]
            if error > best_error:
                best, best_error = d, error
        datasets.append(best)
        samples.append(taken[best])
        taken[best] += 1
    return np.frombuffer(datasets, dtype=np.int16).copy(), np.frombuffer(
        samples, dtype=np.int64
    ).copy()


def cache_key(weights: list[float], size: int) -> str:
    """A hash of everything the index depends on."""
    spec = {"version": BLEND_VERSION, "weights": normalised(weights), "size": size}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def file_crc32(path: str, chunk: int = 1 << 24) -> int:
    """CRC32 of a file's bytes."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _write_atomic(path: str, write: Callable[[BinaryIO], object]) -> None:
    """``write(file)`` into ``path`` under a temporary name, then rename it into place."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def _read_cache(paths: tuple[str, str], crc_path: str, size: int, log: Callable[[str], None]):
    """The cached ``(dataset_index, dataset_sample_index)``, or None (with a logged line when
    a file is there but damaged) when it must be built."""
    if not all(os.path.exists(p) for p in (*paths, crc_path)):
        return None  # not built yet, or a build that ended before its checksums
    try:
        with open(crc_path) as f:
            crcs = json.load(f)
        for path in paths:
            if file_crc32(path) != crcs[os.path.basename(path)]:
                log(
                    f"[data] blend index cache {path} does not match its CRC32 in {crc_path} "
                    "(damaged or edited); rebuilding it"
                )
                return None
        datasets, samples = (np.load(p, allow_pickle=False) for p in paths)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log(
            f"[data] blend index cache {crc_path} is damaged ({type(e).__name__}: {e}); "
            "rebuilding it"
        )
        return None
    if datasets.shape == samples.shape == (size,):
        return datasets, samples
    log(
        f"[data] blend index cache {paths[0]} has shape {datasets.shape}, not ({size},); "
        "rebuilding it"
    )
    return None


def cached_blend_indices(
    weights: list[float], size: int, cache_dir: str | None, log: Callable[[str], None] = print
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`blend_indices`, read from or written to ``cache_dir`` (None: not cached). Writes
    are atomic, and the CRC32 file is written last, so ranks building the same index at once
    leave one good copy and an interrupted build is rebuilt."""
    if cache_dir is None:
        return blend_indices(weights, size)
    cache_dir = os.path.expanduser(cache_dir)
    base = os.path.join(cache_dir, f"blend-{cache_key(weights, size)}")
    paths, crc_path = (base + "-dataset.npy", base + "-sample.npy"), base + "-crc32.json"
    if (cached := _read_cache(paths, crc_path, size, log)) is not None:
        return cached
    start = time.perf_counter()
    datasets, samples = blend_indices(weights, size)
    os.makedirs(cache_dir, exist_ok=True)
    for path, values in zip(paths, (datasets, samples)):
        _write_atomic(path, lambda f, v=values: np.save(f, v, allow_pickle=False))
    crcs = json.dumps({os.path.basename(p): file_crc32(p) for p in paths}, sort_keys=True)
    _write_atomic(crc_path, lambda f: f.write(crcs.encode()))
    log(f"[data] built the blend index of {size:,} samples in {time.perf_counter() - start:.1f} s")
    return datasets, samples


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` global samples drawn from ``datasets`` in proportion to ``weights``."""

    def __init__(
        self,
        datasets: list,
        weights: list[float],
        size: int,
        names: list[str] | None = None,
        cache_dir: str | None = None,
        log: Callable[[str], None] = print,
    ):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = datasets
        self.weights = normalised(weights)
        self.names = names or [f"dataset{i}" for i in range(len(datasets))]
        self.size = size
        self.dataset_index, self.dataset_sample_index = cached_blend_indices(
            self.weights, size, cache_dir, log
        )

    def __len__(self) -> int:
        return self.size

    def counts(self) -> list[int]:
        """Samples each dataset contributes to the blend."""
        return np.bincount(self.dataset_index, minlength=len(self.datasets)).tolist()

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.size:
            raise IndexError(
                f"global sample {index} is beyond the blend's {self.size} samples (built for "
                "trainer.max_steps * trainer.global_batch_size); raise trainer.max_steps to "
                "extend it"
            )
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index])]

    def describe(self) -> list[str]:
        """One line per dataset: weight, samples in the blend, epochs of it they read."""
        lines = []
        for name, w, n, ds in zip(self.names, self.weights, self.counts(), self.datasets):
            epochs = n / max(len(ds), 1)
            lines.append(f"{name}: weight {w:.3f}, {n:,} samples ({epochs:.2f} epochs)")
        return lines
