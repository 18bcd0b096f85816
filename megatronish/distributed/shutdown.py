"""Ending torch.distributed before the interpreter ends: no process-group thread outlives ``main``.

gloo runs worker threads for every process group and a TCP loop per connection context; NCCL a
watchdog and a heartbeat monitor. All of them must be gone before the interpreter finalizes. A
gloo worker that releases a finished op's tensors once finalization has begun needs the GIL, is
ended by Python inside a C++ destructor, and the process aborts (SIGABRT, "terminate called without
an active exception") after a run that finished and saved: torchrun then reports the job as
failed and SLURM requeues a finished job. Destroying a group joins its threads, but only once
nothing references it any more, so the Topology drops its references first
(:meth:`~megatronish.distributed.topology.Topology.close`) and pending work handles go with the
objects that held them (one ``gc.collect``).
"""

from __future__ import annotations

import gc
import os
import threading
import time

import torch.distributed as dist

# Thread names (``/proc/self/task/*/comm``) of gloo, the TCP store and NCCL in torch >= 2.6.
PROCESS_GROUP_THREAD_PREFIXES = ("pt_gloo", "gloo_", "pt_tcpstore", "pt_nccl")


def process_group_threads() -> list[str]:
    """Names of this process's threads that torch.distributed runs (empty without /proc)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name.startswith(PROCESS_GROUP_THREAD_PREFIXES):
            names.append(name)
    return sorted(names)


def _destroy_all() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # every group, then the default one
    gc.collect()  # work handles and groups held only by reference cycles


def shutdown_process_groups(wait_s: float) -> str | None:
    """Destroy every process group of this process and wait for their threads to end.

    Returns None when none is left, else why some are; the caller should then end the process
    without finalizing it (``os._exit``), which cannot abort. Call it after the Topology was
    closed. The groups are destroyed in a helper thread, so a worker still inside an op with a
    peer that is gone or hung costs at most ``wait_s`` seconds instead of blocking the exit.
    """
    helper = threading.Thread(target=_destroy_all, name="megatronish-shutdown", daemon=True)
    helper.start()
    helper.join(wait_s)
    if helper.is_alive():
        return (
            f"destroying the process groups did not finish within {wait_s:g} s "
            "(a peer rank is gone or hung)"
        )
    deadline = time.monotonic() + 1.0  # joined threads take a moment to leave /proc
    while (left := process_group_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    if left:  # e.g. torch's profiler keeps the groups whose ops it recorded
        return f"torch still holds {len(left)} process-group thread(s) after destroying the groups"
    return None
