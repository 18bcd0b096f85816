"""Collectives over a :class:`ParallelGroup`, counted by :class:`CommStats`.

Every collective in megatronish goes through this module, so communication volume can be
measured per group and per op and compared with the analytic volume in tests. A group of size 1
short-circuits every op (no process group is needed for a single process).

Byte accounting (per call, on the calling rank): ``all_reduce`` and ``broadcast`` count the
tensor; ``all_gather`` counts the gathered (full) output; ``reduce_scatter`` counts the full input;
``send`` / ``recv`` count the tensor.

A failed or timed-out op (gloo raises when ``collective_timeout_s`` passes or a peer's connection
closes; NCCL when an op is posted on a communicator its watchdog aborted, or in ``wait()``) is
re-raised as :class:`CollectiveError` naming the group, its ranks and the op; work handles of
asynchronous ops do the same in ``wait()``. NCCL's texts are read by
:mod:`megatronish.distributed.nccl_errors`. A CUDA error is a device fault and passes through.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._compile import _disable_dynamo

from megatronish.distributed.gloo_shards import (
    WorkGroup,
    decomposes,
    gather_by_broadcasts,
    scatter_by_reduces,
)
from megatronish.distributed.nccl_errors import describe_nccl, parse_nccl_failure

# torch 2.13 renamed the tensor collectives; keep one spelling that works from torch 2.6 on.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

T = TypeVar("T")

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class CommStats:
    """Calls and bytes per (group name, op) on this rank."""

    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    enabled: bool = True

    def record(self, group: str, op: str, nbytes: int) -> None:
        if self.enabled:
            self.calls[(group, op)] += 1
            self.bytes[(group, op)] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def summary(self) -> dict[str, dict[str, int]]:
        """``{"group/op": {"calls": n, "bytes": b}}``, sorted by key."""
        keys = sorted(self.calls)
        return {
            f"{g}/{o}": {"calls": self.calls[(g, o)], "bytes": self.bytes[(g, o)]} for g, o in keys
        }


@dataclass
class OpLog:
    """How many ops this rank posted on a group, and the names of the last two (a failure NCCL
    reports on a later op is then named by the one before it)."""

    count: int = 0
    last: str | None = None
    previous: str | None = None

    def post(self, op: str) -> None:
        self.count += 1
        self.previous, self.last = self.last, op


@dataclass
class ParallelGroup:
    """A process group together with this rank's place in it.

    ``ranks`` are global ranks; ``rank`` is this process's index in ``ranks``. ``pg`` is None when
    the group has a single member.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None = None
    stats: CommStats | None = None
    timeout_s: float | None = None  # the process group's collective timeout, for messages
    posted: OpLog = field(default_factory=OpLog, repr=False, compare=False)
    # On gloo, run ZeRO's flat all-gather / reduce-scatter member by member (gloo_shards.py);
    # False keeps gloo's native collectives (the ones NCCL runs), e.g. to test that path.
    decompose_gloo_shards: bool = True

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        return self.ranks[index]

    def handle(self) -> dist.ProcessGroup:
        """The torch process group; refused once the Topology was closed at shutdown (an op
        would otherwise fall through to the default group)."""
        if self.pg is None:
            raise CollectiveError(f"group {self.name} (ranks {list(self.ranks)}) is closed")
        return self.pg

    def record(self, op: str, t: torch.Tensor, numel: int | None = None) -> None:
        """Count an op this rank posts on the group (CommStats and the log of posted ops)."""
        self.posted.post(op)
        if self.stats is not None:
            n = t.numel() if numel is None else numel
            self.stats.record(self.name, op, n * t.element_size())


class CollectiveError(RuntimeError):
    """A collective or point-to-point op failed or timed out; the message names group and op."""


_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused")


def describe_failure(group: ParallelGroup, op: str, error: BaseException) -> str:
    """One line for a failed ``op`` on ``group``: what happened, the likely cause, the fix."""
    nccl = parse_nccl_failure(str(error))
    if nccl is not None:
        return describe_nccl(nccl, group, op)
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and "] " in text:  # drop gloo's "[path/to/file.cc:123] " prefix
        text = text.split("] ", 1)[1]
    where = f"{op} on group {group.name} (ranks {list(group.ranks)})"
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered:
        after = f" after {group.timeout_s:g} s" if group.timeout_s else ""
        return (
            f"{where} timed out{after}: a peer rank died or runs a different schedule; "
            "the first error is in the other ranks' logs (parallel.collective_timeout_s sets "
            f"the limit) [{text}]"
        )
    if any(s in lowered for s in _PEER_GONE):
        return (
            f"{where} failed: a peer rank exited or crashed; the first error is in the other "
            f"ranks' logs [{text}]"
        )
    return f"{where} failed: {text}"


@contextlib.contextmanager
def named_failures(group: ParallelGroup, op: str) -> Iterator[None]:
    """Re-raise a torch.distributed error inside the block as :class:`CollectiveError`."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:  # gloo/nccl errors are RuntimeError (torch.distributed.DistError)
        if _device_fault(e):
            raise
        raise CollectiveError(describe_failure(group, op, e)) from e


def _device_fault(error: RuntimeError) -> bool:
    """A CUDA error (torch.AcceleratorError, ``CUDA error: ...``): the device's, not the op's."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(error, accelerator_error) or str(error).startswith("CUDA error")


class NamedWork:
    """A work handle of an asynchronous op whose ``wait()`` raises :class:`CollectiveError`."""

    def __init__(self, work: dist.Work | WorkGroup, group: ParallelGroup, op: str):
        self.work, self.group, self.op = work, group, op

    def wait(self) -> bool:
        with named_failures(self.group, self.op):
            return self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _named(work: dist.Work | WorkGroup | None, group: ParallelGroup, op: str) -> NamedWork | None:
    return None if work is None else NamedWork(work, group, op)


def between_graphs(group_arg: int) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Mark a collective as opaque to ``torch.compile``: on a group of more than one rank it
    runs eagerly between captured graphs (a graph break), so its process-group call, its
    CommStats count and its named failures are the same in compiled code as in eager code (a
    traced c10d call would be recorded once, at trace time). A group of one is traced (its ops
    are local). ``group_arg``: the position of the :class:`ParallelGroup` argument.

    torch's lazy form of ``torch.compiler.disable``: ``torch.compiler.disable`` itself imports
    dynamo (1.2 s of every process's start-up); this one imports it at its first call, which
    only compiled code makes (eager code calls the collective itself)."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        eager = _disable_dynamo(fn)

        @functools.wraps(fn)
        def collective(*args: Any, **kwargs: Any) -> T:
            group = args[group_arg] if len(args) > group_arg else kwargs["group"]
            if group.size == 1 or not torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            return eager(*args, **kwargs)

        return collective

    return wrap


def single_group(name: str, rank: int = 0, stats: CommStats | None = None) -> ParallelGroup:
    """A group of one: every op on it is the identity."""
    return ParallelGroup(name=name, ranks=(rank,), rank=0, pg=None, stats=stats)


@between_graphs(group_arg=1)
def all_reduce(t: torch.Tensor, group: ParallelGroup, op: str = "sum", async_op: bool = False):
    """In-place all-reduce; returns the tensor (or a work handle when ``async_op``)."""
    if group.size == 1:
        return None if async_op else t
    group.record("all_reduce", t)
    with named_failures(group, "all_reduce"):
        work = dist.all_reduce(t, op=_OPS[op], group=group.handle(), async_op=async_op)
    return _named(work, group, "all_reduce") if async_op else t


@between_graphs(group_arg=1)
def all_gather_dim0(t: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Concatenate every rank's ``t`` along dim 0 (equal shapes)."""
    if group.size == 1:
        return t
    t = t.contiguous()
    out = torch.empty((group.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    group.record("all_gather", out)
    with named_failures(group, "all_gather"):
        _all_gather_single(out, t, group=group.handle())
    return out


@between_graphs(group_arg=2)
def all_gather_into(
    out: torch.Tensor, shard: torch.Tensor, group: ParallelGroup, async_op: bool = False
):
    """All-gather flat ``shard``s into the preallocated flat ``out`` (ZeRO parameter gather)."""
    if group.size == 1:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return None
    group.record("all_gather", out)
    with named_failures(group, "all_gather"):
        if decomposes(group):
            work = gather_by_broadcasts(out, shard, group, async_op)
        else:
            work = _all_gather_single(out, shard, group=group.handle(), async_op=async_op)
    return _named(work, group, "all_gather")


@between_graphs(group_arg=1)
def reduce_scatter_dim0(t: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Sum ``t`` over the group and keep this rank's slice of dim 0."""
    if group.size == 1:
        return t
    t = t.contiguous()
    if t.shape[0] % group.size:
        raise ValueError(f"dim 0 ({t.shape[0]}) is not divisible by {group.name} size {group.size}")
    out = torch.empty((t.shape[0] // group.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
    group.record("reduce_scatter", t)
    with named_failures(group, "reduce_scatter"):
        _reduce_scatter_single(out, t, group=group.handle())
    return out


@between_graphs(group_arg=2)
def reduce_scatter_into(
    out: torch.Tensor, full: torch.Tensor, group: ParallelGroup, async_op: bool = False
):
    """Reduce-scatter flat ``full`` into the flat ``out`` shard (ZeRO gradient reduction).

    ``full`` itself may be overwritten (gloo reduces in place)."""
    if group.size == 1:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full)
        return None
    group.record("reduce_scatter", full)
    with named_failures(group, "reduce_scatter"):
        if decomposes(group):
            work = scatter_by_reduces(out, full, group, async_op)
        else:
            work = _reduce_scatter_single(out, full, group=group.handle(), async_op=async_op)
    return _named(work, group, "reduce_scatter")


@between_graphs(group_arg=1)
def all_gather_uneven(t: torch.Tensor, group: ParallelGroup, sizes: list[int]) -> torch.Tensor:
    """Every member's ``t`` (``sizes[j]`` rows from member ``j``) concatenated along dim 0, as
    Megatron-LM's gather with ``output_split_sizes``: one ``all_gather`` of uneven views on
    NCCL; on gloo, which refuses uneven sizes, one broadcast per member."""
    if group.size == 1:
        return t
    t = t.contiguous()
    out = t.new_empty((sum(sizes), *t.shape[1:]))
    group.record("all_gather", out)
    with named_failures(group, "all_gather"):
        if dist.get_backend(group.handle()) == "gloo":
            gather_by_broadcasts(out, t, group, async_op=False, sizes=sizes)
        else:
            dist.all_gather(list(out.split(sizes)), t, group=group.handle())
    return out


@between_graphs(group_arg=1)
def reduce_scatter_uneven(t: torch.Tensor, group: ParallelGroup, sizes: list[int]) -> torch.Tensor:
    """The sum over members of this member's rows of ``t`` (``sizes[j]`` rows for member ``j``,
    in order along dim 0): one ``reduce_scatter`` of uneven views on NCCL, one reduce per member
    on gloo. ``t`` itself may be overwritten."""
    if group.size == 1:
        return t
    t = t.contiguous()
    out = t.new_empty((sizes[group.rank], *t.shape[1:]))
    group.record("reduce_scatter", t)
    with named_failures(group, "reduce_scatter"):
        if dist.get_backend(group.handle()) == "gloo":
            scatter_by_reduces(out, t, group, async_op=False, sizes=sizes)
        else:
            dist.reduce_scatter(out, list(t.split(sizes)), group=group.handle())
    return out


@between_graphs(group_arg=2)
def all_to_all(
    out: torch.Tensor,
    t: torch.Tensor,
    group: ParallelGroup,
    out_splits: list[int],
    in_splits: list[int],
    async_op: bool = False,
):
    """Send rows ``in_splits[j]`` of ``t`` (dim 0, in order) to member ``j`` and receive
    ``out_splits[j]`` rows from member ``j`` into ``out`` (expert parallelism's token exchange);
    returns ``out`` (or a work handle when ``async_op``: ``out`` is filled once it is waited).
    The bytes counted are the whole of ``t``, the rows a rank keeps included."""
    if group.size == 1:
        out.copy_(t)
        return None if async_op else out
    group.record("all_to_all", t)
    with named_failures(group, "all_to_all"):
        work = dist.all_to_all_single(
            out, t.contiguous(), out_splits, in_splits, group=group.handle(), async_op=async_op
        )
    return _named(work, group, "all_to_all") if async_op else out


@between_graphs(group_arg=1)
def broadcast(t: torch.Tensor, group: ParallelGroup, src_index: int = 0) -> torch.Tensor:
    """Broadcast ``t`` in place from the member at ``src_index``."""
    if group.size == 1:
        return t
    group.record("broadcast", t)
    with named_failures(group, "broadcast"):
        dist.broadcast(t, src=group.global_rank(src_index), group=group.handle())
    return t


@between_graphs(group_arg=1)
def isend(t: torch.Tensor, group: ParallelGroup, peer: int):
    """Asynchronous send to member ``peer`` of ``group``; returns the work handle."""
    group.record("send", t)
    op = f"send to rank {group.global_rank(peer)}"
    with named_failures(group, op):
        work = dist.isend(t, dst=group.global_rank(peer), group=group.handle())
    return NamedWork(work, group, op)


@between_graphs(group_arg=1)
def irecv(t: torch.Tensor, group: ParallelGroup, peer: int):
    """Asynchronous receive into ``t`` from member ``peer`` of ``group``."""
    group.record("recv", t)
    op = f"recv from rank {group.global_rank(peer)}"
    with named_failures(group, op):
        work = dist.irecv(t, src=group.global_rank(peer), group=group.handle())
    return NamedWork(work, group, op)
