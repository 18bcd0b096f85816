"""A rank whose gloo worker finishes an op while the interpreter exits (the exit abort, on demand).

``python -m megatronish.testing.late_work MODE RANK PORT`` on two processes. Rank 1 posts an
all-reduce on a Topology group and returns from its script at once; rank 0 matches it half a
second later, while rank 1 is already exiting. That is what a starved gloo worker did at the end
of a finished training run: it released the op's tensors after the main thread had gone on.

To make it happen every time, rank 1 registers (first, so it runs last) an exit handler that holds
the GIL for 2 s: the worker, done with the op, waits for the GIL to release the op's tensors
until finalization has begun, and Python ends it inside a C++ destructor: SIGABRT.

MODE ``left`` exits with the groups alive (what the entry point did); MODE ``shutdown`` first
closes the Topology and shuts the process groups down as ``megatronish.train`` does at every
exit, so the worker releases the op while the interpreter is intact: exit 0.
"""

import atexit
import ctypes

# PyDLL keeps the GIL during the call (CDLL would release it).
atexit.register(ctypes.PyDLL(None).usleep, 2_000_000)

import datetime  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatronish.distributed.comm import all_reduce  # noqa: E402
from megatronish.distributed.shutdown import shutdown_process_groups  # noqa: E402
from megatronish.distributed.topology import Topology  # noqa: E402


def main(mode: str, rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    topo = Topology.build(tp=1, dp=2, pp=1, rank=rank, timeout_s=30)
    all_reduce(torch.ones(1), topo.dp_group)  # both ranks are here
    if rank == 0:
        time.sleep(0.5)  # rank 1 is exiting by now
        all_reduce(torch.ones(1000), topo.dp_group)
        time.sleep(3.0)  # stay until rank 1 has finished exiting
        os._exit(0)
    all_reduce(torch.ones(1000), topo.dp_group, async_op=True)  # handle dropped: not waited for
    if mode == "shutdown":
        topo.close()
        if shutdown_process_groups(wait_s=10) is not None:
            sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
