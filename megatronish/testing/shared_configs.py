"""Composed configs shared by the processes of a test session.

Hydra takes ~0.3 s to compose a config, and the suite composes the same ones in many processes:
every rank of a forked world builds its trainer from the same overrides, and several tests run
the same layout. With ``MEGATRONISH_TEST_CONFIGS`` naming a folder (tests/conftest.py sets one
per session), the first process to need a config composes it and pickles it there (~1 ms to
read back); the others wait for it on a file lock instead of composing it again. Without the
variable every call composes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
from pathlib import Path

from omegaconf import DictConfig

from megatronish.config.compose import load_config

FOLDER_ENV = "MEGATRONISH_TEST_CONFIGS"


def composed(overrides: list[str]) -> DictConfig:
    """``load_config(overrides)``, composed once per session when the folder is set."""
    folder = os.environ.get(FOLDER_ENV)
    if not folder:
        return load_config(overrides)
    key = hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:32]
    path = Path(folder) / f"{key}.pkl"
    with open(Path(folder) / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        if path.exists():
            with open(path, "rb") as f:
                return pickle.load(f)
        cfg = load_config(overrides)  # a config that does not compose raises, nothing saved
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(pickle.dumps(cfg))
        os.replace(partial, path)
        return cfg
