"""Gradient compression (``parallel.grad_compression``) in the plan: its state, the compressed
reductions' calls and bytes, and the memory traffic compressing costs.

- **State**: int8 keeps an fp32 error buffer the size of every bucket reduced over more than
  one rank; PowerSGD an fp32 error per compressed matrix (``n x m``) and its warm-start ``Q``
  (``m x r``), :mod:`~megatronish.data_parallel.powersgd`'s choice of matrices.
- **Communication** (CommStats' bytes, exactly): int8 replaces each reduce-scatter with one
  all-to-all of ``dp * (shard + 4 ceil(shard / 256))`` bytes; PowerSGD replaces each bucket's
  all-reduce (or ZeRO 1's reduce-scatter) with one all-reduce of its ``P`` factors and the
  uncompressed rest, and one of its ``Q`` factors (when it has a compressed matrix).
- **Compute** (:func:`memory_traffic`): both are memory-bound passes over the grads. int8 reads
  and writes about :data:`INT8_TRAFFIC` bytes per element of each reduction (the error added and
  kept, the quantisation, the received copies dequantised and summed); PowerSGD about
  :data:`POWERSGD_TRAFFIC` per compressed element (the error, three thin matmuls that each read
  the matrix, the result written back) and :data:`COPY_TRAFFIC` per element sent as it is. The
  step-time model adds that traffic at the device's memory bandwidth to the exposed end of the
  step: compression pays where the bytes it saves on the link take longer than that.
"""

from __future__ import annotations

from megatronish.data_parallel.buckets import Bucket
from megatronish.data_parallel.int8_reduce import packed_bytes
from megatronish.data_parallel.powersgd import bucket_matrices
from megatronish.plan.layout import Layout

FP32 = 4
INT8_TRAFFIC = 40  # bytes read and written per element of an int8 reduction
POWERSGD_TRAFFIC = 44  # per element of a compressed matrix
COPY_TRAFFIC = 16  # per element PowerSGD sends uncompressed (gathered and written back)


def _reduced(buckets: list[list[Bucket]]) -> list[Bucket]:
    return [b for bs in buckets for b in bs if b.dp > 1]


def state_bytes(layout: Layout, buckets: list[list[Bucket]]) -> int:
    """Bytes of the compression's state on a rank with ``buckets`` (0 without compression)."""
    if layout.grad_compression == "int8":
        return sum(b.numel for b in _reduced(buckets)) * FP32
    if layout.grad_compression == "powersgd":
        r = layout.powersgd_rank
        mats = [
            m
            for b in _reduced(buckets)
            for m in bucket_matrices(b, r, layout.powersgd_compress_vocab)
        ]
        return sum(m.n * m.m + m.m * r for m in mats) * FP32
    return 0


def reduction_volume(
    layout: Layout, group: str, flat: list[Bucket], rounds: list[int]
) -> dict[str, tuple[int, int]] | None:
    """``{"group/op": (calls, bytes)}`` of the compressed reductions of ``flat`` over ``group``,
    each bucket reduced ``rounds`` times; None without compression (the plain reduction)."""
    kind = layout.grad_compression
    if kind == "int8":
        sent = sum(r * b.dp * packed_bytes(b.numel // b.dp) for r, b in zip(rounds, flat))
        return {f"{group}/all_to_all": (sum(rounds), sent)}
    if kind == "powersgd":
        calls = nbytes = 0
        r = layout.powersgd_rank
        for rounds_b, b in zip(rounds, flat):
            mats = bucket_matrices(b, r, layout.powersgd_compress_vocab)
            rest = b.numel - sum(m.n * m.m for m in mats)
            first = sum(m.n * r for m in mats) + rest
            second = sum(m.m * r for m in mats)
            calls += rounds_b * (1 + bool(mats))
            nbytes += rounds_b * (first + second) * FP32
        return {f"{group}/all_reduce": (calls, nbytes)}
    return None


def memory_traffic(layout: Layout, reduced: list[Bucket], rounds: list[int]) -> int:
    """Bytes the compression reads and writes per step for the buckets ``reduced``, each
    reduced ``rounds`` times."""
    if layout.grad_compression == "int8":
        return sum(r * b.numel for r, b in zip(rounds, reduced)) * INT8_TRAFFIC
    if layout.grad_compression == "powersgd":
        total = 0
        for r, b in zip(rounds, reduced):
            compressed = sum(
                m.n * m.m
                for m in bucket_matrices(b, layout.powersgd_rank, layout.powersgd_compress_vocab)
            )
            total += r * (compressed * POWERSGD_TRAFFIC + (b.numel - compressed) * COPY_TRAFFIC)
        return total
    return 0


def state_key(layout: Layout) -> tuple:
    """The layout fields :func:`state_bytes` reads besides the buckets."""
    return layout.grad_compression, layout.powersgd_rank, layout.powersgd_compress_vocab
