"""Whether a documented training launch would train: the run directory it continues must not
hold its run complete (exit 7) or another run (exit 2); docs/operations.md, "Runs and resumes".
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path


def without_missing_tokenizer(script: str, root: Path) -> tuple[str, str]:
    """A dry check's script without a ``data.tokenizer_model=PATH`` that the sandbox at
    ``root`` lacks (a dry run reads the tokenizer it is given), and a note saying so."""
    found = shlex.split(script)
    missing = [
        w
        for w in found
        if w.startswith("data.tokenizer_model=") and not (root / w.split("=", 1)[1]).exists()
    ]
    if not missing:
        return script, ""
    note = f"(dry run without {', '.join(missing)}: not in the sandbox)"
    return shlex.join(w for w in found if w not in missing), note


def resolved_config(dry_output: str) -> dict | None:
    """The resolved config a dry run printed (the YAML above its ``derived:`` section)."""
    import yaml

    head, found, _ = dry_output.partition("\nderived:\n")
    if not found:
        return None
    lines = [ln for ln in head.splitlines() if not ln.startswith(("note: ", "$ ", "(dry run"))]
    try:
        config = yaml.safe_load("\n".join(lines))
    except yaml.YAMLError:
        return None
    return config if isinstance(config, dict) and "checkpoint" in config else None


def saved_run(root: Path, checkpoint_dir: str) -> tuple[dict, int, str] | None:
    """``(config, step, path)`` of the step that ``checkpoint_dir/latest`` names under
    ``root``; None when there is none."""
    latest = root / checkpoint_dir / "latest"
    if not latest.is_file():
        return None
    step_dir = latest.parent / latest.read_text().strip()
    try:
        meta = json.loads((step_dir / "metadata.json").read_text())
    except (OSError, ValueError):
        return None
    return meta["config"], int(meta["step"]), str(step_dir.relative_to(root))


def identity_problem(config: dict, root: Path, expected: Sequence[int]) -> str:
    """Why the launch of ``config`` (resolved) in the tree at ``root`` would not train as
    documented: the run it continues is another (exit 2) or complete (exit 7, unless in
    ``expected``); "" when it would train."""
    if config["checkpoint"].get("resume") != "auto":
        return ""
    saved = saved_run(root, config["checkpoint"]["dir"])
    if saved is None:
        return ""
    from megatronish.checkpoint.run_identity import ConfigChanged, RunComplete, check_same_run

    try:
        check_same_run(saved[0], saved[1], config, saved[2])
    except ConfigChanged as e:
        return f"the launch would be refused (exit 2): {e}"
    except RunComplete as e:
        if 7 not in expected:
            return f"the launch would exit 7: {config.get('name')}: {e}"
    return ""
