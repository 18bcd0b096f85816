"""A fresh copy of the tree to run documented commands in, and running them there."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

STAMP = ".megatronish-installed"  # the Makefile's install stamp inside .venv


def tree_files(root: Path) -> list[str]:
    """The tracked and untracked-but-not-ignored files of the git tree at ``root`` (what a
    clone of its working tree holds)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (root / name).exists()]


def copy_tree(src: Path, dest: Path) -> None:
    """A clone of ``src``'s working tree at ``dest``: its files (modes and times kept), a git
    index of them, and a .venv linking to ``src``'s."""
    for name in tree_files(src):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / name, dest / name, follow_symlinks=False)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    link_venv(src / ".venv", dest / ".venv")


def link_venv(venv: Path, dest: Path) -> None:
    """``dest``: links to each entry of ``venv`` and an install stamp of its own, newer than
    the copied pyproject.toml, so make never reinstalls: an install would point the shared
    environment's editable install at the sandbox."""
    dest.mkdir()
    for entry in venv.iterdir():
        if entry.name != STAMP:
            (dest / entry.name).symlink_to(entry)
    (dest / STAMP).touch()


def sandbox_env(root: Path) -> dict[str, str]:
    """The environment of every command: the sandbox's .venv first on PATH (``python``,
    ``torchrun``), its code first on the import path, W&B off, offline datasets, one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "HYDRA_FULL_ERROR")}
    env.update(
        PATH=f"{root / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(root),
        WANDB_MODE="disabled",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    return env


def run_bash(script: str, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``(exit code, stdout and stderr)`` of ``bash -c script``; 124 when it ran past
    ``timeout`` seconds (its whole process group is killed)."""
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=cwd,
        env=env,
        text=True,
        errors="replace",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, f"{out}\n(killed after {timeout:.0f} s)"
