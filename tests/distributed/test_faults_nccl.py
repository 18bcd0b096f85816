"""NCCL faults named like gloo's, checked without a GPU.

The texts below follow the formats of torch's ProcessGroupNCCL (WorkNCCL's ``operator<<``,
``Watchdog caught collective operation timeout``, ``checkForNCCLErrorsInternal``, the
``C10D_NCCL_CHECK`` macro, ``NCCLComm::getNcclComm`` after an abort, the ``[PG ID .. PG GUID ..(desc)
Rank ..]`` log prefix) with NCCL's own result-code strings. Each is raised as torch's
``DistBackendError`` from inside a comm wrapper, and the entry point's exit mapping must turn it
into one named line and exit code 6.
"""

import types

import pytest
import torch
import torch.distributed as dist

import megatronish.distributed.comm as comm
import megatronish.train as entry
from megatronish.distributed.comm import CollectiveError, ParallelGroup
from megatronish.distributed.nccl_errors import failed_groups_message, parse_nccl_failure

FIX = (
    "a peer rank died or runs a different schedule; the first error is in the other ranks' logs "
    "(parallel.collective_timeout_s sets the limit)"
)
PEERS = "the first error is in the other ranks' logs"
WATCHDOG = (
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, "
    "NumelIn=4096, NumelOut={out}, Timeout(ms)={ms}) ran for {ran} milliseconds before timing out."
)
DP = "dp (ranks [0, 1])"
REMOTE = (
    "NCCL error: remote process exited or there was a network error, NCCL version 2.21.5\n"
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
    "prematurely.\nLast error:\nNET/IB : Got completion from peer 10.1.1.12<33412> with status=12 "
    "opcode=0 len=0 vendor err 129 (Recv)"
)
REMOTE_LINE = (
    "NCCL error: remote process exited or there was a network error, NCCL version 2.21.5; last "
    "error: NET/IB : Got completion from peer 10.1.1.12<33412> with status=12 opcode=0 len=0 "
    "vendor err 129 (Recv)"
)


def _watchdog(seq, op, out=4096, ms=600000, ran=600075, rank=1):
    return f"[Rank {rank}] " + WATCHDOG.format(seq=seq, op=op, out=out, ms=ms, ran=ran)


def _enqueue_error(what, code, detail, last):
    return (
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "
        f"{what}, NCCL version 2.21.5\n{code}: {detail}\nLast error:\n{last}"
    )


class FakeNcclGroup:
    """A process group whose NCCL backend recorded ``state`` (torch's ErrorType name)."""

    def __init__(self, state: str):
        self.state = state

    def _get_backend(self, device):
        assert device == torch.device("cuda")
        error = types.SimpleNamespace(name=self.state)
        return types.SimpleNamespace(get_error=lambda: error)


def _calling(op: str, group: ParallelGroup, error: BaseException, monkeypatch):
    """A call of megatronish's ``op`` wrapper on ``group`` whose torch op raises ``error``."""

    def fail(*args, **kwargs):
        raise error

    t = torch.ones(4)
    if op == "all_reduce":
        monkeypatch.setattr(dist, "all_reduce", fail)
        return lambda: comm.all_reduce(t, group)
    if op == "all_gather":
        monkeypatch.setattr(comm, "_all_gather_single", fail)
        return lambda: comm.all_gather_dim0(t, group)
    if op == "reduce_scatter":
        monkeypatch.setattr(comm, "_reduce_scatter_single", fail)
        return lambda: comm.reduce_scatter_dim0(t, group)
    if op == "broadcast":
        monkeypatch.setattr(dist, "broadcast", fail)
        return lambda: comm.broadcast(t, group)
    monkeypatch.setattr(dist, "irecv", fail)
    return lambda: comm.irecv(t, group, 1).wait()


# name: (wrapper op, group, NCCL state, ops this rank posted on the group before, text, line)
CASES = {
    "a timeout raised by its own wait (TORCH_NCCL_BLOCKING_WAIT)": (
        "reduce_scatter",
        "dp",
        "TIMEOUT",
        [],
        _watchdog(412, "_REDUCE_SCATTER_BASE", out=2048),
        f"reduce_scatter on group {DP} timed out after 600 s: {FIX} "
        f"[{WATCHDOG.format(seq=412, op='_REDUCE_SCATTER_BASE', out=2048, ms=600000, ran=600075)}]",
    ),
    "an earlier op's timeout raised in the next op": (
        "all_reduce",
        "dp",
        "TIMEOUT",
        ["all_gather"],
        _watchdog(7, "_ALLGATHER_BASE", out=8192),
        f"all_gather (NCCL seq 7) on group {DP} timed out after 600 s (raised in all_reduce): "
        f"{FIX} [{WATCHDOG.format(seq=7, op='_ALLGATHER_BASE', out=8192, ms=600000, ran=600075)}]",
    ),
    "the next op on a communicator the watchdog aborted after a timeout": (
        "all_reduce",
        "dp",
        "TIMEOUT",
        ["reduce_scatter"],
        "NCCL communicator was aborted on rank 1. ",
        f"all_reduce on group {DP} failed: NCCL had aborted the group's communicator after an "
        "earlier op on it timed out (the op this rank posted on it before this one: "
        "reduce_scatter, #1); this rank's log above names it ('Watchdog caught collective "
        f"operation timeout' or 'NCCL error'); {FIX} [NCCL communicator was aborted on rank 1.]",
    ),
    "the next op on a communicator aborted after an NCCL error": (
        "broadcast",
        "dp",
        "COMM_ERROR",
        ["all_reduce", "all_reduce"],
        "NCCL communicator was aborted on rank 0. ",
        f"broadcast on group {DP} failed: NCCL had aborted the group's communicator after an "
        "earlier op on it failed (the op this rank posted on it before this one: all_reduce, #2); "
        "this rank's log above names it ('Watchdog caught collective operation timeout' or 'NCCL "
        f"error'); {PEERS} [NCCL communicator was aborted on rank 0.]",
    ),
    "an aborted communicator with the reason torch kept": (
        "broadcast",
        "dp",
        "TIMEOUT",
        [],
        "NCCL communicator was aborted on rank 0.  Original reason for failure was: "
        + _watchdog(2, "BROADCAST", ms=30000, ran=30012, rank=0),
        f"broadcast on group {DP} timed out after 30 s: {FIX} "
        f"[{WATCHDOG.format(seq=2, op='BROADCAST', out=4096, ms=30000, ran=30012)}]",
    ),
    "a peer that exited (asynchronous ncclRemoteError)": (
        "all_gather",
        "dp",
        "COMM_ERROR",
        [],
        REMOTE,
        f"all_gather on group {DP} failed: a peer rank exited or its network connection broke "
        f"(ncclRemoteError); {PEERS} [{REMOTE_LINE}]",
    ),
    "a socket failure when a receive is posted (ncclSystemError)": (
        "recv",
        "pp",
        "SUCCESS",
        [],
        _enqueue_error(
            "unhandled system error (run with NCCL_DEBUG=INFO for details)",
            "ncclSystemError",
            "System call (e.g. socket, malloc) or external library call failed or device error. ",
            "socketStartConnect: Connect to 10.0.0.3<43521> failed : Software caused connection abort",
        ),
        "recv from rank 4 on group pp (ranks [0, 4]) failed: a system call, the network or the "
        "device failed (ncclSystemError; with older NCCL also a peer rank that exited); "
        f"{PEERS}; check NCCL_SOCKET_IFNAME / NCCL_IB_HCA; NCCL_DEBUG=WARN shows more [NCCL error: "
        "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5; last "
        "error: socketStartConnect: Connect to 10.0.0.3<43521> failed : Software caused connection "
        "abort]",
    ),
    "ncclInternalError": (
        "all_reduce",
        "dp",
        "SUCCESS",
        [],
        _enqueue_error(
            "internal error - please report this issue to the NCCL developers",
            "ncclInternalError",
            "Internal check failed.",
            "Attribute busid of node nic not found",
        ),
        f"all_reduce on group {DP} failed: NCCL failed an internal check (ncclInternalError); "
        "check that every rank runs the same NCCL version; NCCL_DEBUG=WARN shows more [NCCL "
        "error: internal error - please report this issue to the NCCL developers, NCCL version "
        "2.21.5; last error: Attribute busid of node nic not found]",
    ),
    "ncclUnhandledCudaError": (
        "all_gather",
        "dp",
        "SUCCESS",
        [],
        _enqueue_error(
            "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
            "ncclUnhandledCudaError",
            "Call to CUDA function failed.",
            "Cuda failure 'out of memory'",
        ),
        f"all_gather on group {DP} failed: a CUDA call inside NCCL failed "
        "(ncclUnhandledCudaError): a device fault or no memory left; check nvidia-smi and the "
        "kernel log for Xid errors; NCCL_DEBUG=WARN shows more [NCCL error: unhandled cuda error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5; last error: Cuda failure "
        "'out of memory']",
    ),
    "ncclInvalidUsage": (
        "reduce_scatter",
        "dp",
        "SUCCESS",
        [],
        _enqueue_error(
            "invalid usage (run with NCCL_DEBUG=WARN for details)",
            "ncclInvalidUsage",
            "This usually reflects invalid usage of NCCL library.",
            "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000",
        ),
        f"reduce_scatter on group {DP} failed: NCCL refused the call (ncclInvalidUsage / "
        "ncclInvalidArgument): the ranks disagree on the op, its size or dtype, or a tensor is on "
        "another device; NCCL_DEBUG=WARN shows more [NCCL error: invalid usage (run with "
        "NCCL_DEBUG=WARN for details), NCCL version 2.21.5; last error: Duplicate GPU detected : "
        "rank 1 and rank 0 both on CUDA device 1a000]",
    ),
    "another group's watchdog report, by its description": (
        "all_reduce",
        "dp",
        "SUCCESS",
        [],
        "[PG ID 1 PG GUID 3(tp) Rank 1] Process group watchdog thread terminated with exception: "
        + _watchdog(3, "ALLREDUCE", out=4096, ms=2000, ran=2004),
        f"all_reduce (NCCL seq 3) on group tp timed out after 2 s (raised in all_reduce on group "
        f"{DP}): {FIX} [{WATCHDOG.format(seq=3, op='ALLREDUCE', out=4096, ms=2000, ran=2004)}]",
    ),
    "a member that never published its NCCL id": (
        "all_reduce",
        "dp",
        "SUCCESS",
        [],
        "[1] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d "
        "key-value store by key '0', but store->get('0') got error: wait timeout after 600000ms, "
        "keys: /default_pg//cuda//0. This may indicate a possible application crash on rank 0 or "
        "a network set up issue.",
        f"all_reduce on group {DP} failed: setting up its NCCL communicator failed: a member did "
        "not publish its NCCL id (it crashed, hangs or cannot reach the store); "
        f"{PEERS} [[1] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via "
        "c10d key-value store by key '0', but store->get('0') got error: wait timeout after "
        "600000ms, keys: /default_pg//cuda//0. This may indicate a possible application crash on "
        "rank 0 or a network set up issue.]",
    ),
    "torch's generic report": (
        "all_reduce",
        "dp",
        "SUCCESS",
        [],
        "Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA "
        "kernels, subsequent GPU operations might run on corrupted/incomplete data.",
        f"all_reduce on group {DP} failed: {PEERS} [Some NCCL operations have failed or timed "
        "out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run "
        "on corrupted/incomplete data.]",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_nccl_failure_in_an_op_is_one_named_line_and_exit_6(case, monkeypatch, capsys):
    op, name, state, before, text, line = CASES[case]
    ranks = (0, 4) if name == "pp" else (0, 1)
    group = ParallelGroup(name, ranks, 0, pg=FakeNcclGroup(state), timeout_s=600.0)
    for earlier in before:
        group.posted.post(earlier)
    call = _calling(op, group, dist.DistBackendError(text), monkeypatch)
    monkeypatch.setattr(entry, "run", lambda cfg, stop=None, launch=None: call())
    assert entry._run_and_report(None, None, None, "[rank 1] ") == entry.EXIT_COMM == 6
    assert capsys.readouterr().err == f"[rank 1] error: {line}\n"


def test_the_entry_point_exits_6_for_an_nccl_failure(monkeypatch, capsys):
    from megatronish.config.compose import load_config

    group = ParallelGroup("tp", (2, 3), 0, pg=FakeNcclGroup("TIMEOUT"), timeout_s=600.0)
    text = _watchdog(5, "ALLREDUCE")
    call = _calling("all_reduce", group, dist.DistBackendError(text), monkeypatch)
    monkeypatch.setattr(entry, "run", lambda cfg, stop=None, launch=None: call())
    assert entry.main_with_config(load_config(["trainer.device=cpu"])) == 6
    err = capsys.readouterr().err
    assert err.startswith("error: all_reduce on group tp (ranks [2, 3]) timed out after 600 s: ")
    assert err.count("\n") == 1, err


OUTSIDE = {
    # error raised outside the comm wrappers: the printed line, or None where it is no comm failure
    "an NCCL report of the default group": (
        dist.DistBackendError(
            "[PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread terminated with "
            "exception: " + _watchdog(9, "_ALLGATHER_BASE", out=16384, ran=600390, rank=3)
        ),
        f"all_gather (NCCL seq 9) on group world timed out after 600 s: {FIX} "
        f"[{WATCHDOG.format(seq=9, op='_ALLGATHER_BASE', out=16384, ms=600000, ran=600390)}]",
    ),
    "an NCCL error naming no group": (
        dist.DistBackendError(REMOTE),
        f"an NCCL op failed: a peer rank exited or its network connection broke (ncclRemoteError); "
        f"{PEERS} [{REMOTE_LINE}]",
    ),
    "a store connection that broke": (
        dist.DistNetworkError("Connection reset by peer"),
        f"a torch.distributed call failed: Connection reset by peer; {FIX}",
    ),
}


@pytest.mark.parametrize("case", list(OUTSIDE))
def test_a_distributed_error_outside_the_wrappers_is_exit_6(case, monkeypatch, capsys):
    error, line = OUTSIDE[case]

    def run(cfg, stop=None, launch=None):
        raise error

    monkeypatch.setattr(entry, "run", run)
    assert entry._run_and_report(None, None, None, "") == 6
    assert capsys.readouterr().err == f"error: {line}\n"


@pytest.mark.parametrize(
    "error",
    [
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: unspecified launch failure"),
        RuntimeError("shapes differ"),
    ],
)
def test_device_faults_and_other_errors_keep_their_traceback(error, monkeypatch):
    """A CUDA error is the device's fault, not a collective's: exit 1 with the traceback, also
    when it surfaces inside a comm op."""

    def run(cfg, stop=None, launch=None):
        raise error

    monkeypatch.setattr(entry, "run", run)
    with pytest.raises(type(error)):
        entry._run_and_report(None, None, None, "")
    group = ParallelGroup("dp", (0, 1), 0, pg=object(), timeout_s=600.0)
    call = _calling("all_reduce", group, error, monkeypatch)
    raised = CollectiveError if str(error) == "shapes differ" else type(error)
    with pytest.raises(raised):
        call()


@pytest.mark.parametrize(
    "text",
    [
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
        "30000ms for recv operation to complete",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:"
        "534] Connection closed by peer [127.0.0.1]:5000",
        "Connection reset by peer",
    ],
)
def test_gloo_texts_are_not_read_as_nccl(text):
    assert parse_nccl_failure(text) is None


def test_a_failure_recorded_after_the_last_wait_is_found_before_saving():
    groups = [
        ParallelGroup("tp", (0, 1), 0, pg=FakeNcclGroup("SUCCESS")),
        ParallelGroup("dp", (0, 2), 0, pg=FakeNcclGroup("TIMEOUT")),
        ParallelGroup("pp", (0, 4), 0, pg=FakeNcclGroup("COMM_ERROR")),
        ParallelGroup("world", (0, 1, 2, 3), 0, pg=object()),  # gloo: no NCCL state
        ParallelGroup("embedding", (0,), 0),
    ]
    assert failed_groups_message(groups) == (
        "an NCCL op on group dp (ranks [0, 2]) timed out and on group pp (ranks [0, 4]) failed, "
        "found after the last step: nothing is saved from this state; this rank's log above "
        f"names the op; {FIX}"
    )
    assert failed_groups_message(groups[:1] + groups[3:]) is None


def test_a_save_refuses_state_an_aborted_nccl_op_left(tmp_path):
    from megatronish.checkpoint.save import CheckpointSaver
    from megatronish.testing.runs import build_trainer

    trainer = build_trainer(0, 1, [f"checkpoint.dir={tmp_path}"], 1)
    trainer.train_step()
    trainer.topo.groups["tp"].pg = FakeNcclGroup("TIMEOUT")
    with pytest.raises(CollectiveError, match="on group tp .* timed out"):
        CheckpointSaver(trainer.cfg, trainer.checkpoint_parts).save(blocking=True)
    assert not any(p.name.startswith("step_") for p in tmp_path.iterdir())
