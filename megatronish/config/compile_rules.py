"""``trainer.compile``'s rules: the directory inductor keeps its compiled kernels in
(``trainer.compile_cache_dir``), and the note when it is set without compiling."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatronish.config.schema import TrainConfig

CACHE_FIX = "give a directory this user can write (created when missing), or null for torch's cache"


def compile_errors(cfg: TrainConfig, present: bool = True) -> list[str]:
    """The rules of ``trainer.compile_cache_dir``; ``present=False`` (dry runs, the planner,
    which may run on another machine): the path is not looked at."""
    t = cfg.trainer
    path = getattr(t, "compile_cache_dir", None)
    if not present or not path or not t.compile or t.compile_backend != "inductor":
        return []
    why = cache_dir_error(path)
    return [f"trainer.compile_cache_dir={path} {why}: {CACHE_FIX}"] if why else []


def cache_dir_error(path: str) -> str | None:
    """Why inductor could not keep its cache in ``path`` (the trainer hands it over absolute,
    ``~`` expanded), or None. Writability is tried, not read from the mode bits (which root
    ignores): an empty directory is made and removed in the nearest existing one."""
    full = os.path.abspath(os.path.expanduser(path))
    node = full
    while not os.path.exists(node):  # the root always exists
        node = os.path.dirname(node)
    if not os.path.isdir(node):
        return "is a file, not a directory" if node == full else f"is inside the file {node}"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=node))
    except OSError as e:
        return f"cannot be written ({e.strerror or e}: {node})"
    return None


def compile_notes(cfg: TrainConfig) -> list[str]:
    """``trainer.compile_cache_dir`` set without ``trainer.compile``."""
    t = cfg.trainer
    if getattr(t, "compile_cache_dir", None) and not t.compile:
        return [
            f"trainer.compile_cache_dir={t.compile_cache_dir} has no effect without "
            "trainer.compile=true (nothing is compiled)"
        ]
    return []
