"""Gradient compression of the dp reduction (``parallel.grad_compression``): what a compressor
and its reductions offer, and the compressor a config asks for.

- ``powersgd`` (:mod:`~megatronish.data_parallel.powersgd`): low-rank all-reduces, ZeRO 0/1.
- ``int8`` (:mod:`~megatronish.data_parallel.int8_reduce`): a blockwise int8 reduce-scatter,
  ZeRO 1-3.

Both keep error feedback (what compression lost is added to the next step's grads), the state
:meth:`Compressor.state_dict` hands to checkpoints: a resume on the same layout restores it and
continues bit for bit; on another layout (dp, tp, pp, cp, ZeRO stage, buckets) it starts from
zero (:func:`load_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from megatronish.config.schema import ParallelConfig
    from megatronish.data_parallel.buckets import Bucket
    from megatronish.distributed.comm import ParallelGroup

COMPRESSIONS = ("powersgd", "int8")


@dataclass(frozen=True)
class CompressionSettings:
    """``parallel.grad_compression`` and the keys that tune it."""

    kind: str | None = None  # powersgd | int8 | None
    powersgd_rank: int = 4
    powersgd_compress_vocab: bool = False  # the word embedding and output layer too
    start_step: int = 0  # the steps before it reduce uncompressed

    @classmethod
    def of(cls, parallel: ParallelConfig) -> CompressionSettings:
        """The settings of a config's ``parallel`` section."""
        return cls(
            kind=parallel.grad_compression,
            powersgd_rank=parallel.powersgd_rank,
            powersgd_compress_vocab=bool(parallel.powersgd_compress_vocab),
            start_step=parallel.grad_compression_start_step,
        )


NO_COMPRESSION = CompressionSettings()


class CompressedReduction(Protocol):
    """A bucket's compressed reduction in flight."""

    numel: int  # elements of the full grads it stands for
    then: Callable[[], None] | None  # run once the result is in place

    def advance(self) -> None:
        """Start a second collective, if any (called in launch order before any finish)."""

    def finish(self) -> None:
        """Wait and write the reduced sum into the owned grads."""


class Compressor(Protocol):
    """Launches the compressed reductions of a rank's buckets and keeps their state."""

    kind: str

    def launch(
        self,
        bucket: Bucket,
        full: torch.Tensor,
        into: torch.Tensor,
        accumulate: bool,
        group: ParallelGroup,
    ) -> CompressedReduction: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def state_bytes(self) -> int: ...


def make_compressor(
    settings: CompressionSettings, buckets: list[Bucket], seed: int
) -> Compressor | None:
    """The compressor ``settings`` ask for, for ``buckets`` (None: none)."""
    kind = settings.kind
    if kind is None:
        return None
    if kind == "powersgd":
        from megatronish.data_parallel.powersgd import PowerSGD

        return PowerSGD(buckets, settings.powersgd_rank, seed, settings.powersgd_compress_vocab)
    if kind == "int8":
        from megatronish.data_parallel.int8_reduce import Int8Compressor

        return Int8Compressor(buckets)
    raise ValueError(f"grad_compression={kind!r} is not one of {', '.join(COMPRESSIONS)}")


@torch.no_grad()
def load_state(compressor: Compressor, saved: Mapping[str, torch.Tensor]) -> str | None:
    """Restore ``compressor``'s state from ``saved`` (a checkpoint's, this rank's); returns why
    it starts from zero instead (None when restored): the saved state must have the same
    tensors and shapes, i.e. the same layout."""
    mine = compressor.state_dict()
    if not saved:
        return "the checkpoint holds no error feedback of this rank"
    if set(saved) != set(mine) or any(saved[k].shape != mine[k].shape for k in mine):
        return "the checkpoint's error feedback belongs to another layout"
    for key, tensor in mine.items():
        tensor.copy_(saved[key])
    return None
