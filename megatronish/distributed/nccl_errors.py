"""NCCL failures in words: which op on which group failed, why, and what to do.

torch's ProcessGroupNCCL raises ``torch.distributed.DistBackendError`` with one of these texts,
which :func:`parse_nccl_failure` reads:

- a timeout, raised by a ``wait()`` that blocks (``TORCH_NCCL_BLOCKING_WAIT`` or a timeout):
  ``[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE,
  NumelIn=8, NumelOut=8, Timeout(ms)=600000) ran for 600004 milliseconds before timing out.``
- an NCCL result code, found asynchronously (``NCCL error: <what>, NCCL version 2.x``) or when an
  op is posted (``NCCL error in: <file>:<line>, <what>, NCCL version 2.x``), followed by lines
  naming the code (``ncclRemoteError: ...``) and ``Last error:`` with NCCL's own report;
- the next op posted on a group whose communicator the watchdog aborted: ``NCCL communicator was
  aborted on rank 1. `` (with ``Original reason for failure was: <text>`` when torch kept one);
- any of them behind a backend prefix ``[PG ID 2 PG GUID 5(tp) Rank 1] `` naming the group by the
  description Topology gives it (the default group's is ``default_pg``: our ``world``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from megatronish.distributed.comm import ParallelGroup

# torch's OpType names (opTypeToString) -> the op names megatronish uses.
OP_NAMES = {
    "ALLREDUCE": "all_reduce",
    "ALLREDUCE_COALESCED": "all_reduce",
    "_ALLREDUCE_SPARSE": "all_reduce",
    "ALLGATHER": "all_gather",
    "_ALLGATHER_BASE": "all_gather",
    "ALLGATHER_COALESCED": "all_gather",
    "REDUCE_SCATTER": "reduce_scatter",
    "_REDUCE_SCATTER_BASE": "reduce_scatter",
    "REDUCE_SCATTER_TENSOR_COALESCED": "reduce_scatter",
    "BROADCAST": "broadcast",
    "REDUCE": "reduce",
    "GATHER": "gather",
    "SCATTER": "scatter",
    "ALLTOALL": "all_to_all",
    "ALLTOALL_BASE": "all_to_all",
    "SEND": "send",
    "RECV": "recv",
    "RECVANYSOURCE": "recv",
    "BARRIER": "barrier",
    "COALESCED": "batched send/recv",
}
GROUP_OF_DESC = {"default_pg": "world"}  # init_process_group's fixed description

# (text that shows it, kind): NCCL's result codes and ncclGetErrorString's words for them.
_CODES = (
    ("ncclRemoteError", "remote"),
    ("remote process exited", "remote"),
    ("ncclSystemError", "system"),
    ("unhandled system error", "system"),
    ("ncclInternalError", "internal"),
    ("internal error", "internal"),
    ("ncclUnhandledCudaError", "cuda"),
    ("unhandled cuda error", "cuda"),
    ("ncclInvalidUsage", "usage"),
    ("invalid usage", "usage"),
    ("ncclInvalidArgument", "usage"),
    ("invalid argument", "usage"),
)
_PG_PREFIX = re.compile(r"\[PG ID \d+ PG GUID [^\s(\]]*(?:\((?P<desc>[^)]*)\))? Rank \d+\]\s*")
_NOISE = re.compile(r"\[Rank \d+\]\s*|^(?:torch\.distributed\.)?Dist\w*Error:\s*")
_WORK = re.compile(r"WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)")
_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d+)")
_REASON = re.compile(
    r"(?:Original reason for failure was:|encountered error set by ProcessGroupNCCL:"
    r"|watchdog thread terminated with exception:)\s*(?P<reason>.+)",
    re.S,
)
_TIMEOUT_FIX = (
    "a peer rank died or runs a different schedule; the first error is in the other ranks' logs "
    "(parallel.collective_timeout_s sets the limit)"
)
_PEER_LOGS = "the first error is in the other ranks' logs"
_VERBOSE = "NCCL_DEBUG=WARN shows more"
_FAILED = {
    "remote": f"a peer rank exited or its network connection broke (ncclRemoteError); {_PEER_LOGS}",
    "system": "a system call, the network or the device failed (ncclSystemError; with older NCCL "
    f"also a peer rank that exited); {_PEER_LOGS}; check NCCL_SOCKET_IFNAME / NCCL_IB_HCA; "
    f"{_VERBOSE}",
    "internal": "NCCL failed an internal check (ncclInternalError); check that every rank runs "
    f"the same NCCL version; {_VERBOSE}",
    "cuda": "a CUDA call inside NCCL failed (ncclUnhandledCudaError): a device fault or no memory "
    f"left; check nvidia-smi and the kernel log for Xid errors; {_VERBOSE}",
    "usage": "NCCL refused the call (ncclInvalidUsage / ncclInvalidArgument): the ranks disagree "
    f"on the op, its size or dtype, or a tensor is on another device; {_VERBOSE}",
    "setup": "setting up its NCCL communicator failed: a member did not publish its NCCL id "
    f"(it crashed, hangs or cannot reach the store); {_PEER_LOGS}",
    "other": _PEER_LOGS,
}
_CAUSE = {"TIMEOUT": "timed out", "COMM_ERROR": "failed", "REMOTE_ERROR": "failed on another rank"}


@dataclass(frozen=True)
class NcclFailure:
    """What an NCCL error text says: its kind, the failed op and group where it names them."""

    kind: str  # timeout | remote | system | internal | cuda | usage | setup | aborted | other
    detail: str  # the text on one line, without prefixes
    op: str | None = None  # megatronish's name of the failed op (from OpType)
    seq: int | None = None  # NCCL's sequence number of that op on its group
    group: str | None = None  # the group's description, mapped to megatronish's group name
    timeout_s: float | None = None


def _one_line(text: str, limit: int = 300) -> str:
    lines = [_NOISE.sub("", _PG_PREFIX.sub("", ln)).strip() for ln in text.strip().splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        return ""
    first = re.sub(r"^NCCL error in: \S+:\d+, ", "NCCL error: ", lines[0])
    for i, ln in enumerate(lines):
        if ln.startswith("Last error:"):
            last = ln[len("Last error:") :].strip() or (lines[i + 1] if i + 1 < len(lines) else "")
            first += f"; last error: {last}" if last else ""
            break
    return first if len(first) <= limit else first[: limit - 3] + "..."


def parse_nccl_failure(text: str) -> NcclFailure | None:
    """Read an NCCL/ProcessGroupNCCL error text; None when it is not one (gloo, CUDA, ...)."""
    if "nccl" not in text.lower() and "[PG ID " not in text:
        return None
    m = _PG_PREFIX.search(text)
    desc = m.group("desc") if m and m.group("desc") else None
    group = GROUP_OF_DESC.get(desc, desc) if desc else None
    reason = _REASON.search(text)
    if reason and (inner := parse_nccl_failure(reason.group("reason"))) is not None:
        if inner.kind != "other":
            return replace(inner, group=inner.group or group)
    work, ms = _WORK.search(text), _TIMEOUT_MS.search(text)
    op = OP_NAMES.get(work.group("op")) if work else None
    seq = int(work.group("seq")) if work else None
    timeout_s = int(ms.group(1)) / 1000 if ms else None
    lowered = text.lower()
    if "caught collective operation timeout" in lowered or "timed out in blocking wait" in lowered:
        kind = "timeout"
    elif "communicator was aborted" in lowered:
        kind = "aborted"
    elif "setting up nccl communicator" in lowered:
        kind = "setup"
    else:
        kind = next((k for s, k in _CODES if s.lower() in lowered), "other")
    return NcclFailure(kind, _one_line(text), op, seq, group, timeout_s)


def nccl_error_state(pg: dist.ProcessGroup) -> str | None:
    """The error torch's ProcessGroupNCCL recorded for ``pg`` (``TIMEOUT``, ``COMM_ERROR``,
    ``REMOTE_ERROR``); None when it has none, or no NCCL backend (gloo, a closed group)."""
    try:
        state = pg._get_backend(torch.device("cuda")).get_error()  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError, ValueError, TypeError):
        return None
    name = getattr(state, "name", str(state))
    return None if name == "SUCCESS" else name


def describe_nccl(failure: NcclFailure, group: ParallelGroup | None, op: str | None) -> str:
    """One line for ``failure``, raised in ``op`` on ``group`` (both None outside the comm
    wrappers): the failed op and group, timed out or failed, the likely cause and the fix."""
    name = group.name if group is not None else failure.group
    ranks = f" (ranks {list(group.ranks)})" if group is not None else ""
    seq = f" (NCCL seq {failure.seq})" if failure.seq is not None else ""
    on = f" on group {name}" if name else ""
    where = f"{op}{on}{ranks}" if op else f"{failure.op or 'an NCCL op'}{seq}{on}"
    subject, raised_in = where, ""
    other_group = failure.group is not None and failure.group != name
    other_op = failure.op is not None and op is not None and failure.op != op.split()[0]
    if other_group or other_op:
        subject = f"{failure.op or 'an NCCL op'}{seq} on group {failure.group or name}"
        subject += "" if other_group else ranks
        raised_in = (
            f" (raised in {op} on group {name}{ranks})" if other_group else f" (raised in {op})"
        )
    if failure.kind == "timeout":
        limit = failure.timeout_s or (group.timeout_s if group is not None else None)
        after = f" after {limit:g} s" if limit else ""
        return f"{subject} timed out{after}{raised_in}: {_TIMEOUT_FIX} [{failure.detail}]"
    if failure.kind == "aborted":
        return _describe_aborted(failure, group, where)
    return f"{subject} failed{raised_in}: {_FAILED[failure.kind]} [{failure.detail}]"


def _describe_aborted(failure: NcclFailure, group: ParallelGroup | None, where: str) -> str:
    state = nccl_error_state(group.pg) if group is not None else None
    cause = _CAUSE.get(state or "", "failed or timed out")
    before = ""
    if group is not None and (previous := group.posted.previous) is not None:
        n = group.posted.count - 1
        before = f" (the op this rank posted on it before this one: {previous}, #{n})"
    fix = _TIMEOUT_FIX if state == "TIMEOUT" else _PEER_LOGS
    return (
        f"{where} failed: NCCL had aborted the group's communicator after an earlier op on it "
        f"{cause}{before}; this rank's log above names it ('Watchdog caught collective operation "
        f"timeout' or 'NCCL error'); {fix} [{failure.detail}]"
    )


def describe_comm_error(error: BaseException) -> str | None:
    """One line for a torch.distributed or NCCL error raised outside the comm wrappers; None for
    any other error (a CUDA error is a device fault, not a collective's)."""
    text = str(error)
    failure = parse_nccl_failure(text)
    if failure is not None:
        return describe_nccl(failure, None, None)
    if isinstance(error, torch.distributed.DistError):
        first = _one_line(text) or type(error).__name__
        return f"a torch.distributed call failed: {first}; {_TIMEOUT_FIX}"
    return None


def failed_groups_message(groups: Iterable[ParallelGroup]) -> str | None:
    """A line naming the groups whose NCCL backend recorded an error (an op that failed or timed
    out after its last wait); None when every group is healthy or not on NCCL."""
    bad = [(g, s) for g in groups if g.pg is not None and (s := nccl_error_state(g.pg))]
    if not bad:
        return None
    named = " and ".join(
        f"on group {g.name} (ranks {list(g.ranks)}) {_CAUSE.get(s, s)}" for g, s in bad
    )
    return (
        f"an NCCL op {named}, found after the last step: nothing is saved from this state; this "
        f"rank's log above names the op; {_TIMEOUT_FIX}"
    )
