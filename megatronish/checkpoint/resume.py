"""Which checkpoint a run starts from, falling back to an older step when one is damaged.

``checkpoint.resume=auto`` tries the step ``latest`` names, then the older published steps,
newest first. A step that any rank fails to read (a missing or truncated file, a checksum
mismatch, metadata changed after the save) is skipped by every rank together - the ranks agree
after each attempt, so none continues from a different step - and the reason is logged.
``checkpoint.fallback=false`` stops at the first damaged step instead. A checkpoint that does not
fit the model is a config problem, never skipped: older steps would not fit either.
"""

from __future__ import annotations

import os
import random
import secrets
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError

from megatronish.checkpoint.directory import (
    RunLock,
    clean_stale,
    collect_probes,
    damaged_name,
    restore_replaced,
    set_aside_damaged,
    write_latest,
    write_probe,
)
from megatronish.checkpoint.format import (
    CheckpointError,
    Metadata,
    latest_step_name,
    read_metadata,
    resolve_step_dir,
    step_dir_name,
    step_of,
)
from megatronish.checkpoint.load import (
    check_compatible,
    check_tensor_shapes,
    find_resume_path,
    load_into,
)
from megatronish.checkpoint.parts import CheckpointParts
from megatronish.checkpoint.run_identity import ConfigChanged, RunComplete, check_same_run
from megatronish.config.schema import CheckpointConfig
from megatronish.distributed.agree import PeerError, agree
from megatronish.distributed.comm import ParallelGroup, broadcast

DAMAGE = (CheckpointError, OSError, SafetensorError)  # what a damaged checkpoint raises


@dataclass
class ResumePlan:
    """What the start of a run found in ``checkpoint.dir`` and will try to load, in order."""

    candidates: list[str] = field(default_factory=list)  # checkpoint paths, best first
    auto: bool = False  # checkpoint.resume=auto: the candidates are this run's own steps
    fallback: bool = False  # whether a damaged candidate is skipped for the next one
    removed: list[str] = field(default_factory=list)  # leftovers of an interrupted save
    restored: list[str] = field(default_factory=list)  # steps put back after a re-save crash
    lock: RunLock | None = None  # rank 0's hold on checkpoint.dir for this run

    def __enter__(self) -> ResumePlan:
        return self

    def __exit__(self, *exc: object) -> None:
        """The run ends: another run may use ``checkpoint.dir``."""
        if self.lock is not None:
            self.lock.release()


def auto_candidates(ckpt_dir: str, log: Callable[[str], None] = print) -> list[int]:
    """Steps to try for ``resume=auto``: the one ``latest`` names (even if it is gone, so that
    its absence is reported), then the published steps before it, newest first. Without a
    ``latest``, every published step, newest first; the same, with a ``log`` line saying why,
    when ``latest`` cannot be read or names no step."""
    if not os.path.isdir(ckpt_dir):
        return []
    published = sorted(
        (
            s
            for d in os.listdir(ckpt_dir)
            if (s := step_of(d)) is not None and os.path.isdir(os.path.join(ckpt_dir, d))
        ),
        reverse=True,
    )
    try:
        latest = step_of(latest_step_name(ckpt_dir) or "")
    except CheckpointError as e:
        log(f"{e}; trying the published steps newest first")
        latest = None
    if latest is None:
        return published
    return [latest] + [s for s in published if s < latest]


def _log(line: str) -> None:
    print(line, flush=True)


def plan_resume(
    ckpt_cfg: CheckpointConfig, group: ParallelGroup, label: str | None = None
) -> ResumePlan:
    """Collective. Take ``checkpoint.dir`` for this run (:func:`open_checkpoint_dir`), let rank 0
    tidy it after an interrupted save and list the candidates; every rank gets rank 0's list."""
    resume, ckpt_dir = ckpt_cfg.resume, ckpt_cfg.dir
    ckpt_dir = os.path.expanduser(ckpt_dir) if ckpt_dir else None
    auto = resume == "auto"
    plan, steps, error = ResumePlan(auto=auto, fallback=bool(ckpt_cfg.fallback) and auto), [], None
    if ckpt_dir:
        plan.lock = open_checkpoint_dir(ckpt_dir, group, label)
    try:
        if group.rank == 0 and ckpt_dir:
            plan.restored = restore_replaced(ckpt_dir)
            plan.removed = clean_stale(ckpt_dir)
            steps = auto_candidates(ckpt_dir, _log) if resume == "auto" else []
        if resume != "auto":
            path = find_resume_path(resume, ckpt_dir)
            plan.candidates = [path] if path else []
    except (OSError, CheckpointError) as e:
        error = str(e)
    _agree_or_unlock(error, group, plan.lock)
    if resume == "auto" and ckpt_dir:
        steps = _share_ints(steps, group)
        plan.candidates = [os.path.join(ckpt_dir, step_dir_name(s)) for s in steps]
    return plan


def open_checkpoint_dir(ckpt_dir: str, group: ParallelGroup, label: str | None) -> RunLock | None:
    """Collective, at start-up before any step: rank 0 creates ``ckpt_dir`` and locks it for this
    run (a second run on it is refused, naming the first); every rank must be able to write
    there, and rank 0 must see what they wrote (one directory for all, not one per node).
    Returns rank 0's lock (None on other ranks); raises :class:`PeerError` on every rank."""
    lock, error = None, None
    if group.rank == 0:
        try:
            os.makedirs(ckpt_dir, exist_ok=True)
            lock = RunLock.acquire(ckpt_dir, label)
        except CheckpointError as e:
            error = str(e)
        except OSError as e:
            error = (
                f"cannot use checkpoint.dir={ckpt_dir} ({e.strerror}); fix its permissions "
                "or set checkpoint.dir to a writable directory"
            )
    _agree_or_unlock(error, group, lock)
    nonce = _share_ints([random.getrandbits(48)], group)[0]
    _agree_or_unlock(write_probe(ckpt_dir, nonce, group.rank), group, lock)
    error = collect_probes(ckpt_dir, nonce, group.size) if group.rank == 0 else None
    _agree_or_unlock(error, group, lock)
    return lock


def _agree_or_unlock(error: str | None, group: ParallelGroup, lock: RunLock | None) -> None:
    try:
        agree(error, group)
    except PeerError:
        if lock is not None:
            lock.release()
        raise


def _share_ints(values: list[int], group: ParallelGroup) -> list[int]:
    """Rank 0's ``values`` on every rank."""
    count = broadcast(torch.tensor([len(values)], dtype=torch.int64), group)
    data = torch.tensor(values if group.rank == 0 else [0] * int(count.item()), dtype=torch.int64)
    return broadcast(data, group).tolist()


def start_run(plan: ResumePlan, current: dict, group: ParallelGroup) -> str:
    """Collective, before anything is built: the run's logging id, the same on every rank: the
    one stored in the newest candidate, or a new ``NAME-<8 hex>`` (kept in the run's
    checkpoints, so its resumes log to the same W&B run and no other run does).

    Under ``checkpoint.resume=auto`` raises
    :class:`~megatronish.checkpoint.run_identity.ConfigChanged` on every rank when ``current``
    (the resolved config as a dict) is not the run saved there, and
    :class:`~megatronish.checkpoint.run_identity.RunComplete` when that run is complete. Rank 0
    reads the metadata and decides; an unreadable candidate is left to loading (which falls
    back or says why)."""
    code, step, message, run_id = _GO, 0, None, ""
    if group.rank == 0:
        try:
            run_id = _saved_run_id(plan) or f"{current['name']}-{secrets.randbits(32):08x}"
            if plan.auto and plan.candidates:
                _check_same_run(plan.candidates[0], current)
        except ConfigChanged as e:
            code, message = _CHANGED, str(e)
        except RunComplete as e:
            code, step = _COMPLETE, e.step
        except Exception as e:  # noqa: BLE001 - a bug: every rank must stop, not wait
            traceback.print_exc()
            code, message = _FAILED, f"{type(e).__name__}: {e}"
    code, step = _share_ints([code, step], group)
    where = os.path.dirname(plan.candidates[0]) if plan.candidates else "checkpoint.dir"
    if code == _CHANGED:
        raise ConfigChanged(
            message or f"the config differs from the run saved in {where} (rank 0 lists how)"
        )
    if code == _COMPLETE:
        raise RunComplete(step, plan.candidates[0])
    if code == _FAILED:
        raise CheckpointError(message or f"rank 0 failed to read the run saved in {where}")
    return bytes(_share_ints(list(run_id.encode()), group)).decode()


_GO, _CHANGED, _COMPLETE, _FAILED = 0, 1, 2, 3  # start_run's outcomes, shared by rank 0


def _saved_run_id(plan: ResumePlan) -> str | None:
    """The logging run id stored in the first candidate (None if there is none or it is
    unreadable: loading reports why)."""
    if not plan.candidates:
        return None
    try:
        return _read_metadata(plan.candidates[0]).trainer.get("run_id")
    except CheckpointError:
        return None


def _check_same_run(path: str, current: dict) -> None:
    try:
        meta = _read_metadata(path)
    except CheckpointError:
        return
    check_same_run(meta.config, meta.step, current, path)


def _agreed_error(error: str | None, group: ParallelGroup) -> str | None:
    """Collective: the first failing rank's error, the same on every rank (None: all fine)."""
    try:
        agree(error, group)
    except PeerError as e:
        return str(e)
    return None


def _attempt(
    group: ParallelGroup, fn: Callable[..., object], *args: object
) -> tuple[object, str | None]:
    """Collective: ``(fn(*args), None)`` on every rank, or ``(None, why)`` on every rank when
    ``fn`` found damage on any rank. Any other exception (a bug, not the files) stops every rank
    with :class:`PeerError`; the rank that raised it prints its traceback first."""
    value, damage, bug = None, None, None
    try:
        value = fn(*args)
    except DAMAGE as e:
        damage = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - every rank must stop together
        traceback.print_exc()
        bug = f"{type(e).__name__}: {e}"
    agree(bug, group)
    damage = _agreed_error(damage, group)
    return (None, damage) if damage else (value, None)


def load_with_fallback(
    parts: CheckpointParts,
    plan: ResumePlan,
    log: Callable[[str], None] = print,
) -> Metadata | None:
    """Collective. Load the first candidate of ``plan`` that every rank can read into
    ``parts``; returns its metadata (None when there is nothing to resume from).

    Raises :class:`CheckpointError` on every rank when a candidate does not fit the model, when
    a damaged candidate cannot be skipped (``plan.fallback`` off), or when none loads.
    """
    group = parts.topo.world_group
    skipped: list[str] = []
    damaged: list[tuple[str, str]] = []
    for i, path in enumerate(plan.candidates):
        if i > 0:  # a failed attempt may have filled some Adam moments; the next may have none
            for t in (*parts.optimizer.exp_avg, *parts.optimizer.exp_avg_sq):
                t.zero_()
        meta, reason = _attempt(group, _read_metadata, path)
        if reason is None:
            misfit = _attempt(group, _check_fits, meta, parts, path)[1]
            if misfit is not None:
                raise CheckpointError(misfit)
            meta, reason = _attempt(group, load_into, parts, path)
        if reason is None:
            after = f", the newest that loads ({len(skipped)} skipped)" if skipped else ""
            log(f"resumed from {path} at step {meta.step} (saved with {meta.layout}){after}")
            _set_aside(damaged, path, group, log)
            return meta
        if not plan.fallback:
            raise CheckpointError(
                f"cannot resume from {path}: {reason.rstrip('.')}. With checkpoint.resume=auto "
                "and checkpoint.fallback=true the run resumes from the newest step that loads; "
                "checkpoint.resume=never starts from scratch"
            )
        log(f"skipped checkpoint {path}: {reason}")
        skipped.append(f"{os.path.basename(path)} ({reason})")
        damaged.append((path, reason))
    if skipped:
        raise CheckpointError(
            f"no checkpoint could be loaded: {'; '.join(skipped)}. Repair or move the damaged "
            "steps away, give one with checkpoint.resume=PATH, or start from scratch with "
            "checkpoint.resume=never"
        )
    return None


def _set_aside(
    damaged: list[tuple[str, str]],
    loaded: str,
    group: ParallelGroup,
    log: Callable[[str], None],
) -> None:
    """Collective, after ``loaded`` loaded in place of newer ``damaged`` steps: rank 0 renames
    them ``damaged_step_*`` and points ``latest`` at ``loaded``, so that neither ``latest`` nor
    pruning (``checkpoint.keep_last``) ever prefers a damaged step to the one the run uses.
    Every rank logs the new names (the rank that logs may not be rank 0)."""
    if not damaged:
        return
    ckpt_dir, suffixes, error = os.path.dirname(loaded), [], None
    if group.rank == 0:
        try:
            for path, reason in damaged:  # ``latest`` may name a step that is gone: 0
                exists = os.path.isdir(path)
                suffixes.append(
                    set_aside_damaged(ckpt_dir, os.path.basename(path), reason) if exists else 0
                )
            write_latest(ckpt_dir, os.path.basename(loaded))
        except OSError as e:
            error = f"setting aside the damaged checkpoints in {ckpt_dir} failed: {e}"
    agree(error, group)
    for (path, _), n in zip(damaged, _share_ints(suffixes, group)):
        if n:
            log(f"set aside damaged checkpoint {path} as {damaged_name(os.path.basename(path), n)}")


def _read_metadata(path: str) -> Metadata:
    return read_metadata(resolve_step_dir(path))


def _check_fits(meta: Metadata, parts: CheckpointParts, path: str) -> None:
    check_compatible(meta, parts.spec, path, parts.cfg.checkpoint.allow_model_changes)
    check_tensor_shapes(meta, parts.spec, path)
