"""Signals before the trainer's own handlers exist: from the first lines of ``python -m
megatronish.train``, before torch and Hydra are imported (standard library only here).

Importing torch and composing the config take seconds on every rank, and a launcher's stop
signal can arrive then (SIGTERM just after torchrun started its workers). Left its default
action, it would end a rank silently while its peers, already in a collective with it, report a
crash. :class:`StartupSignals` records SIGTERM and SIGUSR2 (the default ``trainer.stop_signals``
besides Ctrl-C) from the start; the entry point hands the record to its
:class:`~megatronish.training.stop.StopRequest`, and the ranks agree to stop as soon as their
process groups exist (exit 4). A Ctrl-C before training aborts: :func:`ctrl_c_aborts` makes the
KeyboardInterrupt one line on stderr and exit code 130, without a traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence

EXIT_ABORTED = 130  # the shell's code for SIGINT
ABORTED = (
    "aborted (a second Ctrl-C, or one during start-up): nothing saved since the last checkpoint"
)
STARTUP_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


def rank_prefix(env: Mapping[str, str] | None = None) -> str:
    """``[rank N] `` under a multi-rank launcher (torchrun's or SLURM's variables), else ''."""
    env = os.environ if env is None else env
    for rank, world in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank in env and int(env.get(world) or 1) > 1:
            return f"[rank {env[rank]}] "
    return ""


@contextlib.contextmanager
def ctrl_c_aborts(enabled: bool = True) -> Iterator[None]:
    """A Ctrl-C (KeyboardInterrupt) inside is one line on stderr and ``sys.exit(130)``; with
    ``enabled`` false (the entry module imported, not run) it propagates."""
    try:
        yield
    except KeyboardInterrupt:
        if not enabled:
            raise
        print(f"{rank_prefix()}{ABORTED}", file=sys.stderr, flush=True)
        sys.exit(EXIT_ABORTED)


class StartupSignals:
    """Records the first stop signal a process gets before its StopRequest takes over."""

    def __init__(self) -> None:
        self.received: str | None = None  # the first signal's name
        self._installed: list[signal.Signals] = []

    @classmethod
    def install(cls, signals: Sequence[signal.Signals] = STARTUP_STOP_SIGNALS) -> StartupSignals:
        """Record ``signals`` from now on (main thread only: elsewhere nothing changes)."""
        startup = cls()
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                signal.signal(sig, startup._record)
                startup._installed.append(sig)
        return startup

    def _record(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def hand_over(self, keep: Sequence[signal.Signals]) -> str | None:
        """Stop recording for the run's stop signals ``keep`` (their new handlers are the
        caller's): the recorded signals not in ``keep`` get their default action back, and one
        of them received already is delivered again now, so the config's choice holds.
        Returns the first signal received among ``keep``, or None."""
        for sig in self._installed:
            if sig not in keep and signal.getsignal(sig) == self._record:
                signal.signal(sig, signal.SIG_DFL)
                if self.received == sig.name:
                    signal.raise_signal(sig)
        names = {sig.name for sig in keep}
        return self.received if self.received in names else None
