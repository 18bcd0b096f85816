"""Whether a run directory's checkpoint belongs to the run being started.

``checkpoint.resume=auto`` continues the run saved in ``checkpoint.dir``. That is only right
when the command describes the same run: a config that differs in anything that changes what
is trained (the model, the data, the optimizer, the schedule, the seed, the global batch, how
the gradient is reduced) is a different run, and continuing the saved one with it would
silently mix the two. Keys that never change the run (:data:`ALWAYS_ALLOWED`: the layout,
logging, checkpointing, the number of steps, compilation, ...) may differ, except the keys of
those sections that do (:data:`CHANGES_THE_RUN`: the gradient compression and the dtype of the
gradient reduction); ``checkpoint.allow_changes`` names more (e.g. ``optimizer.lr`` to lower
the learning rate of a run on purpose), each entry a key or section of the config. The
learning-rate schedule is compared as it runs: ``scheduler.decay_steps`` null decays over
``trainer.max_steps``, so raising ``max_steps`` with it null changes the schedule
(``scheduler.decay_steps=<the saved max_steps>`` keeps it, and the refusal says so). A saved
run at ``trainer.max_steps`` or beyond is complete: there is nothing to train.
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
    # The same blocks, compiled or not (a compile cache on a shared filesystem serves a resume
    # on other nodes).
    "trainer.compile",
    "trainer.compile_backend",
    "trainer.compile_cache_dir",
    "data.prefetch",
    "data.cache_dir",
    # The saved value is the tokenizer's real size; a mismatch is checked with the tensors.
    "model.vocab_size",
)
# Keys of the sections above that change what is trained: the gradient each step applies.
CHANGES_THE_RUN = (
    "parallel.grad_compression",
    "parallel.powersgd_rank",
    "parallel.powersgd_compress_vocab",
    "parallel.grad_compression_start_step",
    "parallel.grad_reduce_dtype",
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


def _always_allowed(key: str) -> bool:
    return _covered(key, ALWAYS_ALLOWED) and not _covered(key, CHANGES_THE_RUN)


def config_changes(
    saved: Mapping[str, Any], current: Mapping[str, Any], allowed: Sequence[str] = ()
) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` of every key both configs have that differs and
    that neither :data:`ALWAYS_ALLOWED` (but :data:`CHANGES_THE_RUN`) nor ``allowed`` covers
    (keys only one side has are a version difference, not a change of the run)."""
    old, new = _with_effective_decay(flatten(saved)), _with_effective_decay(flatten(current))
    return [
        (key, old[key], new[key])
        for key in sorted(old.keys() & new.keys())
        if old[key] != new[key] and not _always_allowed(key) and not _covered(key, allowed)
    ]


def changes_message(changes: Sequence[tuple[str, Any, Any]], path: str) -> str:
    """One line: what differs from the run saved at ``path``, and the ways forward. A changed
    schedule is kept with the saved ``scheduler.decay_steps`` (allowing the change would make
    the learning rate jump to where the new schedule is at the saved step)."""
    diff = "; ".join(
        f"{k}{' (null: trainer.max_steps)' if k == DECAY else ''}: {old!r} (saved) -> {new!r}"
        for k, old, new in changes
    )
    keys = ",".join(k for k, _, _ in changes if k != DECAY)
    decay = [old for k, old, _ in changes if k == DECAY]
    forward = "start a new run in its own directory (name=NEW_NAME or out_dir=DIR)"
    if keys:
        these = "the other changes" if decay else "these changes"
        forward += (
            f", or continue the saved run with {these} on purpose "
            f"(checkpoint.allow_changes=[{keys}])"
        )
    if decay:
        keep = f"keep the saved learning-rate schedule with {DECAY}={decay[0]}"
        forward = f"{keep}. {forward[0].upper()}{forward[1:]}" if keys else f"{keep}, or {forward}"
    return (
        f"checkpoint.resume=auto would continue the run saved at {path}, but this config "
        f"differs from it: {diff}. {forward[0].upper()}{forward[1:]}"
    )


def unknown_allowed(entries: Iterable[str], current: Mapping[str, Any]) -> str | None:
    """One line naming the first ``checkpoint.allow_changes`` entry that is neither a key nor a
    section of ``current`` (a resolved config as a dict), with the closest keys; None if all
    are."""
    from megatronish.config.did_you_mean import closest_keys, did_you_mean

    keys = flatten(current)
    names = {*keys, *(k.rsplit(".", i)[0] for k in keys for i in range(1, k.count(".") + 1))}
    for entry in entries:
        if str(entry) not in names:
            hint = did_you_mean(closest_keys(str(entry)))
            return (
                f"checkpoint.allow_changes has {str(entry)!r}, which is no key or section of the "
                f"config{f'; {hint}' if hint else ''}"
            )
    return None


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
    if (unknown := unknown_allowed(ckpt.get("allow_changes", []), current)) is not None:
        raise ConfigChanged(unknown)
    allowed = [*ckpt.get("allow_changes", []), *model_allowed(ckpt.get("allow_model_changes", []))]
    changes = config_changes(saved_config, current, allowed)
    complete = saved_step >= current["trainer"]["max_steps"]
    if complete:  # nothing will train: the schedule of the steps left does not matter
        changes = [c for c in changes if c[0] != DECAY]
    if changes:
        raise ConfigChanged(changes_message(changes, path))
    if complete:
        raise RunComplete(saved_step, path)
