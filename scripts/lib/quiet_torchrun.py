"""torchrun (``python -m torch.distributed.run``) for scripts/lib/run_torchrun.sh, without its
traceback after a graceful end.

torchrun treats a signal and every non-zero worker as a failure: after a stop signal it prints
the traceback of its own ``SignalException``, after workers that exited 4 (stopped with a
checkpoint) or 7 (the run was already complete) a ``ChildFailedError`` summary with a
traceback, ~40 lines under the workers' one-line reports. Here those end torchrun with its
code 1 and nothing more (run_torchrun.sh then prints one line with the workers' code); any
other failure keeps torchrun's whole report. Arguments: torchrun's.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

# megatronish.train's EXIT_STOPPED and EXIT_COMPLETE (tests/scripts/test_launchers.py checks)
GRACEFUL_CODES = (4, 7)
# torchrun's agent logs the first failed worker at ERROR before it raises ChildFailedError
FAILED_WORKER = "failed (exitcode: %s)"


class _GracefulWorkers(logging.Filter):
    """Drops torchrun's "failed (exitcode: 4) local_rank: ..." line for a graceful code."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = str(record.msg), record.args
        return not (
            msg.startswith(FAILED_WORKER) and isinstance(args, tuple) and args[0] in GRACEFUL_CODES
        )


def graceful(error: ChildFailedError) -> bool:
    """Whether every failed worker exited with a graceful code."""
    return all(f.exitcode in GRACEFUL_CODES for f in error.failures.values())


def run(argv: Sequence[str], torchrun: Callable[[Sequence[str]], object] | None = None) -> int:
    """torchrun's exit code for ``argv`` (0, or 1 after a signal or graceful workers); any
    other failure raises, as torchrun does. ``torchrun``: its ``main`` (injectable)."""
    if torchrun is None:
        from torch.distributed.run import main as torchrun
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_GracefulWorkers())
    try:
        torchrun(list(argv))
    except SignalException:
        return 1  # the agent logged the signal and stopped the workers; their codes follow
    except ChildFailedError as e:
        if not graceful(e):
            raise
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
