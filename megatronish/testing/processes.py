"""Real launches for operations tests: start a job, watch its log, signal or kill its processes.

Only ``/proc`` is used to find processes (no psutil), so this works on Linux only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def start(cmd: list[str], log: Path, env: dict[str, str], cwd: str | None = None):
    """Start ``cmd`` with stdout and stderr in ``log``, in a new session (see :func:`kill_tree`)."""
    out = open(log, "w")  # noqa: SIM115 - the child keeps writing after this returns
    try:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
    finally:
        out.close()


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first."""
    out, todo = [], [pid]
    while todo:
        kids = child_pids(todo.pop())
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    """The command line of ``pid`` ('' when it has exited)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def training_workers(pid: int) -> list[int]:
    """The ``megatronish.train`` processes started (directly or not) by ``pid``: the innermost
    ones, not a wrapper whose command line names the trainer it runs (torchrun's workers run
    under ``scripts/lib/record_exit.sh``)."""
    found = [p for p in descendants(pid) if "megatronish.train" in cmdline(p)]
    return [p for p in found if not set(child_pids(p)) & set(found)]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launch and everything it started (torchrun puts workers in new sessions)."""
    for pid in [*reversed(descendants(proc.pid)), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 240.0) -> str:
    """Poll ``log`` until a line matches ``pattern``; returns the match.

    Fails with the log's tail when the process exits first or ``timeout`` passes.
    """
    regex = re.compile(pattern, re.MULTILINE)
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""
        m = regex.search(text)
        if m:
            return m.group(0)
        if proc.poll() is not None or time.monotonic() > deadline:
            what = f"exited with {proc.returncode}" if proc.poll() is not None else "timed out"
            raise AssertionError(f"no line matching {pattern!r}; the job {what}:\n{text[-4000:]}")
        time.sleep(0.05)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 240.0) -> tuple[int, str]:
    """Wait for the launch to exit (killing it after ``timeout``); returns (exit code, log)."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(
            f"the job did not exit within {timeout}s:\n{log.read_text()[-4000:]}"
        ) from None
    return code, log.read_text(errors="replace")


def checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file of a checkpoint step, keyed ``file:name``."""
    tensors = {}
    for path in sorted(step_dir.glob("*.safetensors")):
        for key, value in load_file(path).items():
            tensors[f"{path.name}:{key}"] = value
    return tensors
