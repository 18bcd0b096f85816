"""How files are published: whole (written beside, then renamed into place) and with the modes
the umask gives, also when written through private temporary files.

A file created with ``open()`` gets ``0o666 & ~umask`` and a directory ``0o777 & ~umask``:
readable by the group and others under the usual umask 022, private under 077. Some writers
create a private temporary file and rename it into place: safetensors' ``save_file`` (0600,
whatever the umask), ``tempfile.mkstemp`` (0600) and ``mkdtemp`` (0700). Checkpoints, exports
and datasets are read by teammates, so what those writers publish gets the mode an ordinary
``open()`` or ``mkdir()`` would have given it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable


def current_umask() -> int:
    """This process's umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # Elsewhere it can only be read by setting it: 0o077 meanwhile, so that a file another
    # thread creates in that instant is too private rather than too open.
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike) -> None:
    """Give ``path`` the mode ``open()`` (a file: 0o666) or ``mkdir()`` (a directory: 0o777)
    would have given it under the current umask."""
    base = 0o777 if stat.S_ISDIR(os.stat(path).st_mode) else 0o666
    os.chmod(path, base & ~current_umask())


def save_safetensors(tensors: dict, path: str, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``, the file's mode following the umask (``save_file`` renames a
    private temporary file into place: 0600)."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    follow_umask(path)


def write_atomic(path: str, write: Callable[[str], object]) -> None:
    """``write(tmp_path)``, then rename it to ``path``: a reader sees the old file or the whole
    new one, never a part (the temporary file is removed on failure)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
