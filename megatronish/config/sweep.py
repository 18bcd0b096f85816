"""Run directories of a Hydra multirun (``-m``): every job of a sweep trains in its own.

``python -m megatronish.train -m optimizer.lr=1e-3,6e-4`` runs one job per value. Each job's
``out_dir`` (so its checkpoints, log file and W&B run) is ``<out_dir>/<its swept values>``,
e.g. ``outputs/tiny/optimizer.lr=0.001``: a name made only of the job's own values of the swept
keys, so every rank of a job agrees on it, and running the same sweep again resumes each job
where it stopped (or says it is complete).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence

MAX_NAME = 120  # longer names keep their start and a hash of all of it
UNSAFE = re.compile(r"[^A-Za-z0-9._=,+@-]")


def swept_keys(argv: Sequence[str]) -> set[str] | None:
    """The keys a command line sweeps (``k=a,b``, ``k=range(...)``, ``k=choice(...)``, ...);
    None when the overrides do not parse (Hydra reports that itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return None
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


def job_dir_name(job_overrides: Sequence[str], swept: set[str] | None) -> str:
    """A directory name for a sweep job: its ``key=value`` overrides of the ``swept`` keys (all
    of them when None), sorted and joined by commas; path separators and other unsafe
    characters become ``_``; no override is ``default``."""
    keep = []
    for override in job_overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if swept is None or key in swept:
            keep.append(override)
    text = ",".join(sorted(keep))
    name = UNSAFE.sub("_", text) or "default"
    if len(name) > MAX_NAME:
        digest = hashlib.sha1(text.encode()).hexdigest()[:10]
        name = f"{name[: MAX_NAME - 11]}-{digest}"
    return name


def sweep_job_dir(out_dir: str, swept: set[str] | None) -> str | None:
    """Inside a Hydra job: in a multirun, the job's run directory below ``out_dir``; None
    otherwise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return os.path.join(out_dir, job_dir_name(list(hydra_cfg.overrides.task), swept))
