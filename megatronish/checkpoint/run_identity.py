"""Whether a run directory's checkpoint belongs to the run being started.

``checkpoint.resume=auto`` continues the run saved in ``checkpoint.dir``. That is only right
when the command describes the same run: a config that differs in anything that changes what
is trained (the model, the data, the optimizer, the schedule, the seed, the global batch) is a
different run, and continuing the saved one with it would silently mix the two. Keys that
never change the run (:data:`ALWAYS_ALLOWED`: the layout, logging, checkpointing, the number
of steps, ...) may differ; ``checkpoint.allow_changes`` names more (e.g. ``optimizer.lr`` to
lower the learning rate of a run on purpose). The learning-rate schedule is compared as it
runs: ``scheduler.decay_steps`` null decays over ``trainer.max_steps``, so raising
``max_steps`` with it null changes the schedule (``scheduler.decay_steps=<the saved
max_steps>`` keeps it). A saved run at ``trainer.max_steps`` or beyond is complete: there is
nothing to train.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Keys (or sections) that may differ between a saved run and its resume.
ALWAYS_ALLOWED = (
    "name",
    "out_dir",
    "world_size",
    "parallel",
    "checkpoint",
    "logging",
    "trainer.max_steps",
    "trainer.micro_batch_size",
    "trainer.device",
    "trainer.num_threads",
    "trainer.eval_interval",
    "trainer.eval_iters",
    "trainer.dry_run",
    "trainer.exit_after_minutes",
    "trainer.stop_signals",
    "trainer.peak_tflops",
    "trainer.check_memory",
    "trainer.max_skipped_steps",
    "trainer.profile",
    "trainer.recompute",
    "trainer.recompute_method",
    "trainer.recompute_num_layers",
    "trainer.tf32",
    "trainer.deterministic",
    "data.prefetch",
    "data.cache_dir",
    # The saved value is the tokenizer's real size; a mismatch is checked with the tensors.
    "model.vocab_size",
)


class ConfigChanged(ValueError):
    """The config differs from the saved run's in keys that change the run."""


class RunComplete(Exception):
    """The saved run already reached ``trainer.max_steps``."""

    def __init__(self, step: int, path: str):
        super().__init__(f"already complete at step {step} ({path}); nothing to train")
        self.step, self.path = step, path


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists are values)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


DECAY = "scheduler.decay_steps"


def _with_effective_decay(flat: dict[str, Any]) -> dict[str, Any]:
    """``scheduler.decay_steps`` as the schedule uses it: null means ``trainer.max_steps``; a
    constant schedule has none."""
    out = dict(flat)
    if out.get("scheduler.style") == "constant":
        out.pop(DECAY, None)
    elif DECAY in out and out[DECAY] is None:
        out[DECAY] = out.get("trainer.max_steps")
    return out


def _covered(key: str, allowed: Iterable[str]) -> bool:
    return any(key == a or key.startswith(f"{a}.") for a in allowed)


def config_changes(
    saved: Mapping[str, Any], current: Mapping[str, Any], allowed: Sequence[str] = ()
) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` of every key both configs have that differs and
    that neither :data:`ALWAYS_ALLOWED` nor ``allowed`` covers (keys only one side has are a
    version difference, not a change of the run)."""
    old, new = _with_effective_decay(flatten(saved)), _with_effective_decay(flatten(current))
    allowed = (*ALWAYS_ALLOWED, *allowed)
    return [
        (key, old[key], new[key])
        for key in sorted(old.keys() & new.keys())
        if old[key] != new[key] and not _covered(key, allowed)
    ]


def changes_message(changes: Sequence[tuple[str, Any, Any]], path: str) -> str:
    """One line: what differs from the run saved at ``path``, and the ways forward."""
    diff = "; ".join(
        f"{k}{' (null: trainer.max_steps)' if k == DECAY else ''}: {old!r} (saved) -> {new!r}"
        for k, old, new in changes
    )
    keys = ",".join(k for k, _, _ in changes)
    return (
        f"checkpoint.resume=auto would continue the run saved at {path}, but this config "
        f"differs from it: {diff}. Start a new run in its own directory (name=NEW_NAME or "
        f"out_dir=DIR), or continue the saved run with these changes on purpose "
        f"(checkpoint.allow_changes=[{keys}])"
    )


def model_allowed(allow_model_changes: Iterable[str]) -> list[str]:
    """``checkpoint.allow_model_changes`` entries as config keys (``rope_theta`` ->
    ``model.rope_theta``)."""
    return [f"model.{k}" for k in allow_model_changes]


def check_same_run(
    saved_config: Mapping[str, Any], saved_step: int, current: Mapping[str, Any], path: str
) -> None:
    """Raise :class:`ConfigChanged` when ``current`` (a resolved config as a dict) is another
    run than the one saved at ``path``, :class:`RunComplete` when that run has nothing left."""
    ckpt = current.get("checkpoint", {})
    allowed = [*ckpt.get("allow_changes", []), *model_allowed(ckpt.get("allow_model_changes", []))]
    changes = config_changes(saved_config, current, allowed)
    complete = saved_step >= current["trainer"]["max_steps"]
    if complete:  # nothing will train: the schedule of the steps left does not matter
        changes = [c for c in changes if c[0] != DECAY]
    if changes:
        raise ConfigChanged(changes_message(changes, path))
    if complete:
        raise RunComplete(saved_step, path)
