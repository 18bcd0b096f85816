"""Graceful stop: a signal or ``trainer.exit_after_minutes`` ends training at a step boundary.

A signal handler only records which signal arrived. At every step boundary the trainer asks
:meth:`StopRequest.agreed_late`, one all-reduce (MAX) of this rank's reason code over the world
(a host tensor: gloo, never a device sync) posted at one boundary and read at the next, so every
rank stops after the same step even when only some ranks got the signal or their clocks disagree
about the deadline, and the host never waits for the world at a boundary (its cost at scale is
in ``docs/operations.md``); before training, :meth:`StopRequest.agreed` asks at once. The
trainer then saves a checkpoint and the process exits with ``EXIT_STOPPED`` (see
``megatronish/train.py``). Signals that arrive
before the request exists, while the entry point still imports torch, are recorded by
:mod:`megatronish.training.startup_signals` and handed over by :meth:`StopRequest.take_over`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

import torch

from megatronish.config.validate import ConfigError
from megatronish.distributed.comm import ParallelGroup, all_reduce
from megatronish.training.startup_signals import StartupSignals

# Reason codes, ordered: when ranks disagree the all-reduce MAX picks the highest.
NO_STOP, DEADLINE, SIGNAL = 0, 1, 2
CTRL_C_NOTICE = (
    "Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again to abort without saving)\n"
)


def parse_signals(names: Sequence[str]) -> list[signal.Signals]:
    """``["SIGTERM", "USR2"]`` -> signals; raises ConfigError naming every unknown name."""
    found, unknown = [], []
    for name in names:
        key = str(name).strip().upper()
        key = key if key.startswith("SIG") else f"SIG{key}"
        sig = getattr(signal.Signals, key, None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            unknown.append(str(name))
        elif sig not in found:
            found.append(sig)
    if unknown:
        raise ConfigError(
            [
                f"trainer.stop_signals has {', '.join(unknown)}: not a signal a process can "
                "handle; use names like SIGTERM, SIGUSR1, SIGUSR2, SIGINT (or [] for none)"
            ]
        )
    return found


def deadline_after(start: float, minutes: float | None) -> float | None:
    """The clock value at which ``minutes`` have passed since ``start`` (None: no deadline)."""
    return None if minutes is None else start + 60.0 * minutes


class StopRequest:
    """This rank's reasons to stop (signals received, deadline passed) and the agreed outcome.

    ``clock`` is injectable so the deadline logic is testable without waiting.
    """

    def __init__(
        self,
        signals: Sequence[signal.Signals] = (),
        exit_after_minutes: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        notice: bool = True,
    ):
        if exit_after_minutes is not None and exit_after_minutes <= 0:
            raise ConfigError(
                [
                    f"trainer.exit_after_minutes={exit_after_minutes} must be positive; "
                    "use null to train until trainer.max_steps"
                ]
            )
        self.signals = list(signals)
        self.exit_after_minutes = exit_after_minutes
        self.clock = clock
        self.deadline = deadline_after(clock(), exit_after_minutes)
        self.received: str | None = None  # name of the first stop signal this process got
        self.notice = notice  # print the Ctrl-C notice (one rank per job does)
        self._sigints = 0  # Ctrl-C presses so far
        self.reason: str | None = None  # why the ranks agreed to stop; None while training
        self._previous: dict[signal.Signals, object] = {}
        self._posted: tuple | None = None  # agreed_late's all-reduce in flight, and its tensor

    @classmethod
    def from_config(
        cls, trainer_cfg, clock: Callable[[], float] = time.monotonic, notice: bool = True
    ) -> StopRequest:
        """From ``trainer.stop_signals`` and ``trainer.exit_after_minutes``."""
        signals = parse_signals(trainer_cfg.stop_signals)
        return cls(signals, trainer_cfg.exit_after_minutes, clock, notice)

    # -- signal handlers (main thread only) ---------------------------------------------------
    def install(self, ctrl_c: bool = True) -> None:
        """Handle the stop signals in this process until :meth:`uninstall`; with ``ctrl_c``
        false all but SIGINT (a Ctrl-C then keeps aborting). Installing again adds SIGINT.

        Python runs signal handlers in the main thread only; elsewhere (a run started from a
        thread) the signals keep their actions and only the deadline applies.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            if sig not in self._previous and (ctrl_c or sig != signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def take_over(self, startup: StartupSignals | None) -> None:
        """From now on (start-up included) handle the stop signals but Ctrl-C, and count the one
        the entry point's :class:`StartupSignals` recorded before, if any, as received."""
        self.install(ctrl_c=False)
        if startup is not None:
            earlier = startup.hand_over(self.signals)
            if self.received is None:
                self.received = earlier

    def uninstall(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> StopRequest:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        # The check posted after the run's last step is never read; its work handle would keep
        # the world group alive past the run (groups are destroyed once nothing holds them).
        self._posted = None
        self.uninstall()

    def _on_signal(self, signum, frame) -> None:
        # Runs between bytecodes of the main thread: only record, act at the step boundary.
        # A second Ctrl-C aborts: KeyboardInterrupt, as without a handler.
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1:
                raise KeyboardInterrupt
            if self.notice:  # os.write: print() may be mid-write in the main thread
                os.write(2, CTRL_C_NOTICE.encode())
        if self.received is None:
            self.received = signal.Signals(signum).name

    # -- the decision -------------------------------------------------------------------------
    def local_code(self) -> int:
        """This rank's reason code: SIGNAL, DEADLINE or NO_STOP."""
        if self.received is not None:
            return SIGNAL
        if self.deadline is not None and self.clock() >= self.deadline:
            return DEADLINE
        return NO_STOP

    def describe(self, code: int) -> str:
        """Words for an agreed reason code, as logged."""
        if code == SIGNAL:
            return f"signal {self.received}" if self.received else "a stop signal on another rank"
        if self.exit_after_minutes is None:
            return "trainer.exit_after_minutes reached on another rank"
        return f"trainer.exit_after_minutes={self.exit_after_minutes} reached"

    def agreed(self, group: ParallelGroup) -> str | None:
        """Collective (one all-reduce of a host tensor): why every rank stops after this step,
        or None. The code never touches the GPU: on NCCL runs the groups route host tensors
        through gloo (see :func:`~megatronish.distributed.launch.init_process_group`), so asking
        every step makes the host wait for no device work, only for the other ranks' hosts."""
        code = torch.tensor([float(self.local_code())])  # on the host, on purpose
        all_reduce(code, group, op="max")
        agreed = int(code.item())
        if agreed != NO_STOP:
            self.reason = self.describe(agreed)
        return self.reason

    @property
    def posted_code(self) -> torch.Tensor | None:
        """The host tensor of the all-reduce :meth:`agreed_late` posted and has not read yet."""
        return None if self._posted is None else self._posted[1]

    def agreed_late(self, group: ParallelGroup) -> str | None:
        """Collective, at every step boundary: :meth:`agreed` a step late, so the host never
        waits for the world. Reads the all-reduce posted at the previous boundary (long done:
        a step ran since) and posts this boundary's code without waiting, so every rank stops
        after the same step, the one after the boundary that first saw a reason. One rank
        alone has no one to ask and stops at once."""
        if group.size == 1:
            return self.agreed(group)
        posted, self._posted = self._posted, None
        if posted is not None:
            work, code = posted
            work.wait()
            agreed = int(code.item())
            if agreed != NO_STOP:
                self.reason = self.describe(agreed)
                return self.reason
        code = torch.tensor([float(self.local_code())])  # on the host, on purpose
        self._posted = (all_reduce(code, group, op="max", async_op=True), code)
        return self.reason
