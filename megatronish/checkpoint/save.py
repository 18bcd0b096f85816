"""Saving: every rank writes its unique shards, then one rename publishes the step.

1. Rank 0 creates ``checkpoint.dir/.tmp_step_XXXXXXX``; every rank snapshots its pieces (the
   collectives that un-shard ZeRO state run here, in the training thread) and writes its
   safetensors files plus a small index, flushed to disk.
2. When every rank has written (one all-reduce), rank 0 merges the indexes into
   ``metadata.json``, renames the directory to ``step_XXXXXXX``, updates ``latest`` and prunes
   old steps beyond ``checkpoint.keep_last``.

With ``async_save`` step 1's file writing runs in a background thread; the trainer polls at each
step boundary and publishes once every rank has finished. A crash before the rename leaves only a
``.tmp_`` directory, which the next start removes (``directory.clean_stale``); a crash inside the
re-save of an existing step leaves that step under ``.tmp_old_``, which the next start puts back.

The snapshot (:mod:`megatronish.checkpoint.snapshot`) queues its device->host copies without
waiting for them; the writer thread waits for them before it reads a byte (blocking saves too).
Only a run with ``async_save`` copies into pinned host buffers (on GPUs, kept for the next
save); a run without copies each save into new pageable host memory, as saves always did.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch
from omegaconf import OmegaConf

from megatronish.checkpoint.directory import (
    REPLACED_PREFIX,
    fsync_path,
    prune,
    published_latest,
    write_latest,
)
from megatronish.checkpoint.format import (
    FORMAT_VERSION,
    METADATA,
    TMP_PREFIX,
    CheckpointError,
    Metadata,
    Shard,
    TensorEntry,
    crc32_of,
    step_dir_name,
)
from megatronish.checkpoint.host_copies import HostCopies, host_copies_for
from megatronish.checkpoint.parts import CheckpointParts
from megatronish.checkpoint.rank_files import file_record, rank_file_name
from megatronish.checkpoint.snapshot import start_snapshot
from megatronish.config.schema import TrainConfig
from megatronish.distributed.agree import PeerError, agree
from megatronish.distributed.comm import CollectiveError, all_reduce
from megatronish.distributed.nccl_errors import failed_groups_message
from megatronish.file_modes import save_safetensors

COPIES_WAIT_S = 30.0  # join_writer's longest wait for a writer's device->host copies


def write_failure(path: str, error: BaseException) -> str:
    """``path: cause`` for a failed write (safetensors wraps the OS error in its own text)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    for wrapper in ("Error while serializing: ", "I/O error: "):
        text = text.removeprefix(wrapper)
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.strerror} (errno {error.errno})"
    return f"{path}: {text}"


def write_rank_files(
    tmp_dir: str, rank: int, tensors: dict[str, dict[str, torch.Tensor]], index: list[dict]
) -> None:
    """Write this rank's safetensors files and index (its shard entries and what metadata.json
    records of each file: :func:`~megatronish.checkpoint.rank_files.file_record`), flushed to
    disk.

    Raises OSError naming the file and the cause (disk full, file size limit, I/O error).
    """
    names = {kind: rank_file_name(kind, rank) for kind in tensors}
    files = {}
    for kind, group in tensors.items():
        path = os.path.join(tmp_dir, names[kind])
        try:
            save_safetensors(group, path)  # mode from the umask, not 0600
            fsync_path(path)
        except Exception as e:  # noqa: BLE001 - SafetensorError is not an OSError
            raise OSError(write_failure(path, e)) from e
        described = {e["key"] for e in index if e["file"] == kind}
        files[names[kind]] = file_record(path, group, described)
    for entry in index:
        group = tensors[entry["file"]]
        entry["crc32"] = crc32_of(group[entry["key"]])
        entry["file"] = names[entry["file"]]
    path = os.path.join(tmp_dir, f"index-rank{rank:05d}.json")
    try:
        with open(path, "w") as f:
            json.dump({"tensors": index, "files": files}, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise OSError(write_failure(path, e)) from e


def merge_and_publish(
    ckpt_dir: str, tmp_dir: str, step: int, world: int, header: dict, keep_last: int
) -> str:
    """Rank 0: build metadata.json from the indexes, rename, update ``latest``, prune."""
    tensors: dict[str, TensorEntry] = {}
    files: dict[str, dict] = {}
    for rank in range(world):
        path = os.path.join(tmp_dir, f"index-rank{rank:05d}.json")
        with open(path) as f:
            written = json.load(f)
        for e in written["tensors"]:
            entry = tensors.setdefault(e["name"], TensorEntry(e["shape"], e["dtype"]))
            entry.shards.append(Shard(e["file"], e["key"], e["offsets"], e["crc32"]))
        files.update(written["files"])
        os.remove(path)
    meta = Metadata(format_version=FORMAT_VERSION, tensors=tensors, files=files, **header)
    with open(os.path.join(tmp_dir, METADATA), "w") as f:
        f.write(meta.to_json())
        f.flush()
        os.fsync(f.fileno())
    final = os.path.join(ckpt_dir, step_dir_name(step))
    old = None
    if os.path.exists(final):  # re-saving a step (e.g. after a resume) replaces it
        old = os.path.join(ckpt_dir, REPLACED_PREFIX + step_dir_name(step))
        os.rename(final, old)
    os.rename(tmp_dir, final)
    fsync_path(ckpt_dir)
    write_latest(ckpt_dir, step_dir_name(step))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    prune(ckpt_dir, keep_last, keep=step_dir_name(step))
    return final


class CopiesGate:
    """Between a writer thread that waits for its snapshot's copies and :meth:`CheckpointSaver.
    join_writer`, which may give up on copies that never complete (a stuck GPU stream)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False

    def done(self) -> bool:
        """The writer's wait for its copies returned (or failed): whether it may write."""
        with self._lock:
            self._done.set()
            return not self._abandoned

    def abandon_after(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` seconds for :meth:`done`; when it was not called by then, it
        returns False from now on. Returns whether the save was abandoned."""
        if self._done.wait(wait_s):
            return False
        with self._lock:
            self._abandoned = not self._done.is_set()
            return self._abandoned


class PendingSave(NamedTuple):
    """An unpublished save."""

    step: int
    tmp_dir: str
    thread: threading.Thread  # the writer
    header: dict  # the metadata besides the tensors
    errors: list[str]  # the writer's
    gate: CopiesGate


@dataclass(frozen=True)
class Saving:
    """What a run's checkpoints record besides its :class:`CheckpointParts`: the logging run
    id and the tokenizer's special token ids (for exports)."""

    run_id: str | None = None
    special_tokens: dict | None = None


class CheckpointSaver:
    """Periodic, final and asynchronous saves of a run's :class:`CheckpointParts`."""

    def __init__(
        self,
        cfg: TrainConfig,
        parts: CheckpointParts,
        run_id: str | None = None,
        special_tokens: dict | None = None,
        copies: HostCopies | None = None,
    ) -> None:
        """``copies``: the device->host copy layer of every save (default: the one for the
        parts' device and ``checkpoint.async_save``, see
        :func:`~megatronish.checkpoint.host_copies.host_copies_for`)."""
        self.cfg, self.parts = cfg, parts
        self.copies = copies or host_copies_for(parts.topo.device, bool(cfg.checkpoint.async_save))
        self.special_tokens = dict(special_tokens or {})  # the tokenizer's, recorded for exports
        self.dir = os.path.expanduser(cfg.checkpoint.dir)
        self.run_id = run_id
        self.config_dict = OmegaConf.to_container(cfg, resolve=True)
        # The real vocabulary (the tokenizer's when model.vocab_size is null) for exports.
        self.config_dict["model"]["vocab_size"] = parts.spec.vocab_size
        self.pending: PendingSave | None = None
        self.last_published: str | None = None

    def _header(self, optimizer_steps: int | None = None) -> dict:
        """The metadata besides the tensors; ``optimizer_steps`` defaults to the optimizer's
        count (a host read of a device value)."""
        t, p = self.parts, self.cfg.parallel
        if optimizer_steps is None:
            optimizer_steps = t.optimizer.step_count
        return {
            "step": t.progress.step,
            "consumed_samples": t.progress.consumed_samples,
            "layout": {
                "tp": t.topo.tp,
                "cp": t.topo.cp,
                "pp": t.topo.pp,
                "dp": t.topo.dp,
                "vpp": p.vpp,
                "ep": t.topo.ep,
                "sp": bool(p.sp),
                "zero_stage": p.zero_stage,
                "world_size": t.topo.world_size,
            },
            "config": self.config_dict,
            "trainer": {
                "skipped_steps": t.progress.skipped_steps,
                "optimizer_steps": optimizer_steps,
                "run_id": self.run_id,
            },
            "tokenizer": self.special_tokens,
        }

    def save(self, blocking: bool | None = None) -> str | None:
        """Save the current step. Collective. Returns the published path (None while async).

        The run's pending steps are settled first; while the last of them were skipped
        (``skipped_in_a_row``) nothing is saved, as in the training loop: one line is logged and
        None returned."""
        self.parts.settle()  # learn the skips (and skipped_steps) of steps run before this
        self.wait()
        topo, step = self.parts.topo, self.parts.progress.step
        if in_a_row := self.parts.progress.skipped_in_a_row:  # state a skip streak may poison
            self.parts.log(f"not saving step {step}: the last {in_a_row} step(s) were skipped")
            return None
        if (failed := failed_groups_message(topo.groups.values())) is not None:
            raise CollectiveError(failed)  # never save what an aborted NCCL op left behind
        blocking = (not self.cfg.checkpoint.async_save) if blocking is None else blocking
        tmp_dir = os.path.join(self.dir, TMP_PREFIX + step_dir_name(step))
        error = None
        if topo.rank == 0:
            try:
                os.makedirs(self.dir, exist_ok=True)
                shutil.rmtree(tmp_dir, ignore_errors=True)
                os.makedirs(tmp_dir)
            except OSError as e:
                error = f"saving checkpoint step {step} failed: {write_failure(tmp_dir, e)}"
        self._agree(error, tmp_dir)  # the directory exists for everyone
        shot = start_snapshot(self.parts, self.copies)
        header = self._header(optimizer_steps=0)  # the writer sets it from the snapshot
        errors: list[str] = []
        gate = CopiesGate()

        def write() -> None:
            try:
                shot.copied.wait()
                if not gate.done():
                    return  # join_writer gave up on the copies: nothing is written at exit
                header["trainer"]["optimizer_steps"] = int(shot.optimizer_steps)
                write_rank_files(tmp_dir, topo.rank, shot.tensors, shot.index)
            except Exception as e:  # noqa: BLE001 - reported on every rank by _publish
                gate.done()
                errors.append(f"saving checkpoint step {step} failed: {e}")

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        self.pending = PendingSave(step, tmp_dir, thread, header, errors, gate)
        if blocking:
            return self.wait()
        return None

    def poll(self) -> str | None:
        """At a step boundary: publish a finished async save once every rank has written."""
        if self.pending is None:
            return None
        done = torch.tensor([0.0 if self.pending[2].is_alive() else 1.0])
        all_reduce(done, self.parts.topo.world_group, op="min")
        return self._publish() if done.item() == 1.0 else None

    def wait(self) -> str | None:
        """Finish a pending save (every rank waits for its writer, then it is published)."""
        if self.pending is None:
            return None
        self.pending[2].join()
        return self._publish()

    def join_writer(self, wait_s: float | None = None) -> str | None:
        """Wait until a background write has finished, without publishing it (a run that ends
        on an error leaves no thread writing files into the interpreter's exit).

        The writer first waits for its device->host copies, which a stuck GPU stream never
        completes: after ``wait_s`` seconds of that (default :data:`COPIES_WAIT_S`, at most
        ``parallel.collective_timeout_s``) the save is abandoned (its writer writes nothing if
        the copies ever complete, it is never published), one line on stderr names it, and that
        line is returned, so the exit goes on. Writing the files is waited for in full."""
        pending = self.pending
        if pending is None:
            return None
        if wait_s is None:
            wait_s = min(COPIES_WAIT_S, self.cfg.parallel.collective_timeout_s)
        if pending.gate.abandon_after(wait_s):
            self.pending = None
            topo = self.parts.topo
            prefix = f"[rank {topo.rank}] " if topo.world_size > 1 else ""
            line = (
                f"{prefix}note: checkpoint step {pending.step} was not saved: its "
                f"device-to-host copies did not complete within {wait_s:g} s (a GPU stream "
                f"is stuck); {pending.tmp_dir} stays unpublished"
            )
            print(line, file=sys.stderr, flush=True)
            return line
        pending.thread.join()
        return None

    def _publish(self) -> str:
        step, tmp_dir, _, header, errors, _ = self.pending
        self.pending = None
        topo = self.parts.topo
        self._agree(errors[0] if errors else None, tmp_dir)  # every rank's files are on disk
        path, error = os.path.join(self.dir, step_dir_name(step)), None
        if topo.rank == 0:
            try:
                path = merge_and_publish(
                    self.dir, tmp_dir, step, topo.world_size, header, self.cfg.checkpoint.keep_last
                )
            except OSError as e:
                error = f"publishing checkpoint step {step} failed: {e}"
        self._agree(error, tmp_dir)  # published before anyone reads it
        self.last_published = path
        return path

    def _agree(self, error: str | None, tmp_dir: str) -> None:
        """Collective: on any rank's failure, rank 0 removes the unpublished step and every rank
        raises :class:`CheckpointError` with the first failure and what is still published."""
        topo = self.parts.topo
        try:
            agree(error, topo.world_group)
        except PeerError as e:
            latest = None
            if topo.rank == 0:
                shutil.rmtree(tmp_dir, ignore_errors=True)
                latest = published_latest(self.dir)
            raise CheckpointError(
                f"{e}; the checkpoints published before are unchanged"
                + (f" (latest: {latest})" if latest else "")
                + ". Free space or repair checkpoint.dir's filesystem and relaunch: the run "
                "resumes from the latest checkpoint"
            ) from None
