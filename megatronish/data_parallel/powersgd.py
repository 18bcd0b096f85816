"""PowerSGD gradient compression with error feedback (``grad_compression=powersgd``).

Vogels et al. 2019, as torch's ``powerSGD_hook`` runs it, on ZeRO 0/1's flat buckets: every
parameter of a bucket that is a matrix ``n x m`` large enough to gain (``n m > 2 (n + m) r``, the
hook's minimum compression rate) is compressed to rank ``r`` (``parallel.powersgd_rank``); the
rest of the bucket (vectors, small matrices, padding) is all-reduced as it is. Per bucket:

1. ``M = grad + error`` (the error feedback), ``P = M Q`` with ``Q`` the last step's (warm
   start; the first is drawn from a seed every dp rank shares);
2. all-reduce ``[P..., uncompressed...]`` (one call), orthonormalise each ``P`` (Gram-Schmidt in
   fp32);
3. ``Q = M^T P``, all-reduce ``[Q...]`` (one call);
4. the bucket's grads become ``P Q^T`` (the compressed sum over dp) and the uncompressed sums;
   ``error = M - P Q^T / dp`` (what this rank's share of the average lost), ``Q`` is kept.

So a matrix sends ``(n + m) r`` numbers instead of ``n m``. Under ZeRO 1 the all-reduces replace
the reduce-scatter (each rank then reads its shard of the result). The state it adds is an fp32
error per compressed matrix and its ``Q``, which checkpoints keep (:meth:`PowerSGD.state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.data_parallel.buckets import Bucket, reduced_over_ranks
from megatronish.distributed.comm import NamedWork, ParallelGroup, all_reduce
from megatronish.tensor_parallel.sharding import param_info

MIN_COMPRESSION_RATE = 2.0  # torch's powerSGD_hook default: compress when it saves 2x or more


def compressible(shape: torch.Size, rank: int) -> tuple[int, int] | None:
    """``(n, m)`` of a parameter of ``shape`` viewed as a matrix (its first dim by the rest) when
    rank-``rank`` compression saves at least :data:`MIN_COMPRESSION_RATE`; else None."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    return (n, m) if n * m > MIN_COMPRESSION_RATE * (n + m) * rank else None


@dataclass(frozen=True)
class Matrix:
    """A compressed parameter of a bucket: its elements ``[offset, offset + n m)``."""

    offset: int
    n: int
    m: int


def bucket_matrices(bucket: Bucket, rank: int, compress_vocab: bool = False) -> list[Matrix]:
    """The parameters of ``bucket`` PowerSGD compresses, in bucket order (the vocabulary's
    matrices only when ``compress_vocab``)."""
    out = []
    for (_, p), offset in zip(bucket.params, bucket.offsets):
        if param_info(p).vocab and not compress_vocab:
            continue
        if (nm := compressible(p.shape, rank)) is not None:
            out.append(Matrix(offset, *nm))
    return out


def uncompressed_ranges(bucket: Bucket, matrices: list[Matrix]) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of ``bucket`` outside its compressed matrices (padding
    included)."""
    out, pos = [], 0
    for mat in matrices:
        if mat.offset > pos:
            out.append((pos, mat.offset))
        pos = mat.offset + mat.n * mat.m
    if pos < bucket.numel:
        out.append((pos, bucket.numel))
    return out


def orthonormalize(p: torch.Tensor, eps: float = 1e-8) -> None:
    """Gram-Schmidt on the columns of ``p`` (``n x r``, fp32), in place (torch's hook's)."""
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        col.div_(col.norm() + eps)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_(col @ (col.t() @ rest))


class PowerSGDReduction:
    """One bucket's PowerSGD reduction: launched with P's all-reduce, advanced to Q's, then
    finished (see the module docstring)."""

    def __init__(self, state: BucketState, full: torch.Tensor, group: ParallelGroup):
        self.state, self.full, self.group = state, full, group
        self.numel = full.numel()
        self.then = None
        self.ms = [full[a.offset : a.offset + a.n * a.m].view(a.n, a.m) for a in state.matrices]
        for m, error in zip(self.ms, state.errors):
            m.add_(error)
        ps = [m @ q for m, q in zip(self.ms, state.qs)]
        rest = [full[a:b] for a, b in state.ranges]
        self.first = torch.cat([p.reshape(-1) for p in ps] + rest)
        self.work: NamedWork | None = all_reduce(self.first, group, async_op=True)
        self.second: torch.Tensor | None = None
        self.ps: list[torch.Tensor] = []
        self.advanced = False

    def advance(self) -> None:
        """P's all-reduce done: write the uncompressed sums, orthonormalise P, start Q's (once;
        a later call does nothing)."""
        if self.advanced:
            return
        self.advanced = True
        if self.work is not None:
            self.work.wait()
        pos = 0
        for mat in self.state.matrices:
            p = self.first[pos : pos + mat.n * self.state.rank].view(mat.n, self.state.rank)
            orthonormalize(p)
            self.ps.append(p)
            pos += p.numel()
        for a, b in self.state.ranges:
            self.full[a:b].copy_(self.first[pos : pos + b - a])
            pos += b - a
        self.work = None
        if self.ps:
            self.second = torch.cat([(m.t() @ p).reshape(-1) for m, p in zip(self.ms, self.ps)])
            self.work = all_reduce(self.second, self.group, async_op=True)

    def finish(self) -> None:
        self.advance()
        if self.work is not None:
            self.work.wait()
        pos, rank, members = 0, self.state.rank, self.group.size
        for i, (mat, m, p) in enumerate(zip(self.state.matrices, self.ms, self.ps)):
            q = self.second[pos : pos + mat.m * rank].view(mat.m, rank)
            pos += q.numel()
            total = p @ q.t()  # the compressed sum over dp
            self.state.errors[i].copy_(m - total / members)
            m.copy_(total)
            self.state.qs[i].copy_(q)
        if self.then is not None:
            self.then()


class BucketState:
    """A bucket's compressed matrices, their error feedback and warm-start ``Q``."""

    def __init__(self, bucket: Bucket, rank: int, generator: torch.Generator, compress_vocab: bool):
        self.rank = rank
        self.matrices = bucket_matrices(bucket, rank, compress_vocab)
        self.ranges = uncompressed_ranges(bucket, self.matrices)
        device = bucket.device
        self.errors = [torch.zeros(a.n, a.m, device=device) for a in self.matrices]
        self.qs = [torch.randn(a.m, rank, generator=generator).to(device) for a in self.matrices]


class PowerSGD:
    """PowerSGD's state for every bucket of a rank and the reductions it launches."""

    kind = "powersgd"

    def __init__(self, buckets: list[Bucket], rank: int, seed: int, compress_vocab: bool = False):
        generator = torch.Generator().manual_seed(seed)  # the same Q on every dp rank
        # buckets reduced over more than one rank, by their place in the rank's bucket list
        self.states = {
            i: BucketState(b, rank, generator, compress_vocab)
            for i, b in enumerate(buckets)
            if reduced_over_ranks(b)
        }
        self.index = {id(b): i for i, b in enumerate(buckets)}

    @torch.no_grad()
    def launch(
        self,
        bucket: Bucket,
        full: torch.Tensor,
        into: torch.Tensor,
        accumulate: bool,
        group: ParallelGroup,
    ) -> PowerSGDReduction:
        """Start ``bucket``'s reduction: ``full`` (its grads, in place) ends up holding the sum
        over dp; ``into`` must be ``full`` or a view of it (ZeRO 0/1)."""
        if accumulate or into.untyped_storage().data_ptr() != full.untyped_storage().data_ptr():
            raise ValueError("PowerSGD reduces whole buckets in place (ZeRO 0 or 1)")
        return PowerSGDReduction(self.states[self.index[id(bucket)]], full, group)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, state in self.states.items():
            for j, (error, q) in enumerate(zip(state.errors, state.qs)):
                out[f"powersgd_error/{i}/{j}"] = error
                out[f"powersgd_q/{i}/{j}"] = q
        return out

    def state_bytes(self) -> int:
        return sum(t.numel() * 4 for t in self.state_dict().values())
