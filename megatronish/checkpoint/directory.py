"""The checkpoint directory: what is in it besides published steps, and who may change it.

``checkpoint.dir`` holds published ``step_XXXXXXX/`` directories, ``latest`` (the newest published
step's name), ``.megatronish.lock`` (held by the run using the directory), and transient
``.tmp_*`` entries (a save in progress, a step being replaced or pruned, a start-up probe).
Steps that failed to load at resume while an older step loaded are renamed ``damaged_step_*``,
with the reason in ``DAMAGED.txt``: out of the way of ``latest`` and pruning, kept for a person.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shutil
import socket

from megatronish.checkpoint.format import (
    LATEST,
    TMP_PREFIX,
    CheckpointError,
    latest_step_name,
    step_of,
)

REPLACED_PREFIX = f"{TMP_PREFIX}old_"  # a published step while its re-save is being published
DAMAGED_PREFIX = "damaged_"
LOCK_NAME = ".megatronish.lock"


def fsync_path(path: str) -> None:
    """Flush a file, or a directory's entries (so a rename in it survives a power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_latest(ckpt_dir: str, name: str) -> None:
    """Point ``latest`` at step directory ``name`` (atomically, flushed)."""
    tmp = os.path.join(ckpt_dir, f"{TMP_PREFIX}{LATEST}")
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, LATEST))
    fsync_path(ckpt_dir)


def read_latest(ckpt_dir: str) -> str | None:
    """The step name ``latest`` holds (None without a ``latest`` that names a step; see
    :func:`~megatronish.checkpoint.format.latest_step_name` for why)."""
    try:
        return latest_step_name(ckpt_dir)
    except CheckpointError:
        return None


def published_latest(ckpt_dir: str) -> str | None:
    """The step directory ``latest`` names, when it is there."""
    name = read_latest(ckpt_dir)
    return name if name and os.path.isdir(os.path.join(ckpt_dir, name)) else None


def prune(ckpt_dir: str, keep_last: int | None, keep: str | None = None) -> None:
    """Remove published steps beyond the newest ``keep_last`` (None keeps all), never ``keep``
    (the step ``latest`` names, kept whatever its number). Steps set aside as damaged are not
    published steps: they are neither counted nor removed."""
    if keep_last is None:
        return
    steps = sorted(
        d
        for d in os.listdir(ckpt_dir)
        if step_of(d) is not None and d != keep and os.path.isdir(os.path.join(ckpt_dir, d))
    )
    kept = max(keep_last - (keep is not None), 0)
    for old in steps[: len(steps) - kept]:
        # Renamed first: a crash during the removal leaves a .tmp_ directory, not a partial step.
        doomed = os.path.join(ckpt_dir, f"{TMP_PREFIX}pruned_{old}")
        try:
            os.rename(os.path.join(ckpt_dir, old), doomed)
        except OSError:  # already gone: nothing to prune
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def damaged_name(name: str, n: int) -> str:
    """The name of step directory ``name`` set aside as damaged (``n`` > 1: the n-th time)."""
    return f"{DAMAGED_PREFIX}{name}" + (f"-{n}" if n > 1 else "")


def set_aside_damaged(ckpt_dir: str, name: str, reason: str) -> int:
    """Rename the damaged step ``name`` to :func:`damaged_name` (the first free one) with the
    reason in ``DAMAGED.txt``; returns the ``n`` of the name."""
    n = 1
    while os.path.exists(os.path.join(ckpt_dir, damaged_name(name, n))):
        n += 1
    target = damaged_name(name, n)
    os.rename(os.path.join(ckpt_dir, name), os.path.join(ckpt_dir, target))
    with open(os.path.join(ckpt_dir, target, "DAMAGED.txt"), "w") as f:
        f.write(f"set aside at resume: {reason}\nrename it back to {name} to try it again\n")
    fsync_path(ckpt_dir)
    return n


def restore_replaced(ckpt_dir: str) -> list[str]:
    """Put back steps a crash left renamed aside in the middle of a re-save (the new copy was
    never published); returns their names."""
    if not os.path.isdir(ckpt_dir):
        return []
    restored = []
    for d in sorted(os.listdir(ckpt_dir)):
        step = d[len(REPLACED_PREFIX) :]
        if d.startswith(REPLACED_PREFIX) and not os.path.exists(os.path.join(ckpt_dir, step)):
            os.rename(os.path.join(ckpt_dir, d), os.path.join(ckpt_dir, step))
            restored.append(step)
    return restored


def clean_stale(ckpt_dir: str) -> list[str]:
    """Remove what a crash during a save or a prune left behind; returns the removed names.

    A step renamed aside by an interrupted re-save is put back first (:func:`restore_replaced`).
    Raises OSError naming an entry that cannot be removed.
    """
    restore_replaced(ckpt_dir)
    if not os.path.isdir(ckpt_dir):
        return []
    stale = sorted(d for d in os.listdir(ckpt_dir) if d.startswith(TMP_PREFIX))
    for d in stale:
        path = os.path.join(ckpt_dir, d)
        try:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise OSError(
                f"cannot remove {path}, left by an interrupted save ({e.strerror}); "
                "remove it by hand"
            ) from e
    return stale


def probe_name(nonce: int, rank: int) -> str:
    return f"{TMP_PREFIX}probe-{nonce:x}-rank{rank:05d}"


def write_probe(ckpt_dir: str, nonce: int, rank: int) -> str | None:
    """Create this rank's probe file in ``ckpt_dir``; the reason when it cannot (else None)."""
    path = os.path.join(ckpt_dir, probe_name(nonce, rank))
    try:
        os.makedirs(ckpt_dir, exist_ok=True)  # a node without it creates its own: found below
        with open(path, "w") as f:
            f.write(str(rank))
    except OSError as e:
        return (
            f"checkpoint.dir={ckpt_dir} is not writable ({e.strerror}); fix its permissions or "
            "set checkpoint.dir to a writable directory"
        )
    return None


def collect_probes(ckpt_dir: str, nonce: int, world: int) -> str | None:
    """Rank 0: remove every rank's probe; the reason when some are not there (else None)."""
    missing = []
    for rank in range(world):
        try:
            os.remove(os.path.join(ckpt_dir, probe_name(nonce, rank)))
        except FileNotFoundError:
            missing.append(rank)
    if not missing:
        return None
    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    return (
        f"checkpoint.dir={ckpt_dir} is not one directory for every rank: rank 0 does not see the "
        f"files that ranks {shown} wrote there; put it on a filesystem that every node mounts"
    )


class RunLock:
    """An exclusive ``flock`` on ``checkpoint.dir/.megatronish.lock`` held by one run's rank 0.

    The kernel releases it when the process ends, however it ends (kill -9 included), so a lock
    never outlives its run. The file names the holder (host, pid, start time) for the message a
    second run gets.
    """

    def __init__(self, fd: int | None, path: str):
        self.fd, self.path = fd, path

    @classmethod
    def acquire(cls, ckpt_dir: str, run_id: str | None = None) -> RunLock:
        """Lock ``ckpt_dir`` for this process; raises CheckpointError naming the holder."""
        path = os.path.join(ckpt_dir, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides, as for open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(
                    f"checkpoint.dir={ckpt_dir} is in use by another run ({holder}); two runs "
                    "saving into one directory overwrite each other's steps. Wait for it to "
                    "end or stop it, or give this run its own checkpoint.dir"
                ) from None
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                print(
                    f"warning: the filesystem of checkpoint.dir={ckpt_dir} does not support "
                    "file locks; nothing stops a second run from using the same directory",
                    flush=True,
                )
                return cls(None, path)
            raise
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        info = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id, "started": now}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None

    __del__ = release


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        return f"host {info['host']}, pid {info['pid']}, started {info['started']}" + (
            f", run {info['run_id']}" if info.get("run_id") else ""
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
