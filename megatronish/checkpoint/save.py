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
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

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
from megatronish.checkpoint.pieces import (
    copy_threads,
    full_local_values,
    param_rects,
    saved_name,
    writes,
)
from megatronish.distributed.agree import PeerError, agree
from megatronish.distributed.comm import CollectiveError, all_reduce
from megatronish.distributed.nccl_errors import failed_groups_message
from megatronish.tensor_parallel.random import RNGTracker
from megatronish.tensor_parallel.sharding import global_shape

KINDS = ("model", "exp_avg", "exp_avg_sq")


def snapshot(trainer, rng) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict]]:
    """This rank's tensors to write (CPU copies) and their index entries. Collective."""
    zero, topo = trainer.zero, trainer.topo
    tensors: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}, "rng": {}}
    index = []
    with copy_threads():
        _snapshot_buckets(zero, trainer.optimizer, topo, tensors, index)
    if rng is not None:
        tensors["rng"] = {k: v.clone() for k, v in rng.state_dict().items()}
    return tensors, index


def _snapshot_buckets(zero, optimizer, topo, tensors, index) -> None:
    for i, bucket in enumerate(zero.buckets):
        flats = full_local_values(zero, optimizer, i, bucket)
        for (name, p), offset in zip(bucket.params, bucket.offsets):
            if not writes(name, p, bucket, offset, topo.coords.tp):
                continue
            gname = saved_name(name, p)
            for r, rect in enumerate(param_rects(p, topo.coords.tp, topo.tp)):
                for kind, flat in zip(KINDS, flats):
                    local = flat[offset : offset + p.numel()].view(p.shape)
                    piece = rect.take(local).detach().to("cpu", copy=True).contiguous()
                    key = f"{kind}/{gname}@{r}"
                    tensors["model" if kind == "model" else "optim"][key] = piece
                    index.append({"name": f"{kind}/{gname}", "key": key, "offsets": rect.offsets,
                                  "shape": list(global_shape(p, topo.tp)), "dtype": "float32",
                                  "file": "model" if kind == "model" else "optim"})  # fmt: skip


def write_failure(path: str, error: BaseException) -> str:
    """``path: cause`` for a failed write (safetensors wraps the OS error in its own text)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    for wrapper in ("Error while serializing: ", "I/O error: "):
        text = text.removeprefix(wrapper)
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.strerror} (errno {error.errno})"
    return f"{path}: {text}"


def write_rank_files(tmp_dir: str, rank: int, tensors, index) -> None:
    """Write this rank's safetensors files and index, flushed to disk.

    Raises OSError naming the file and the cause (disk full, file size limit, I/O error).
    """
    names = {kind: f"{kind}-rank{rank:05d}.safetensors" for kind in tensors}
    for kind, group in tensors.items():
        path = os.path.join(tmp_dir, names[kind])
        try:
            save_file(group, path)
            fsync_path(path)
        except Exception as e:  # noqa: BLE001 - SafetensorError is not an OSError
            raise OSError(write_failure(path, e)) from e
    for entry in index:
        group = tensors[entry["file"]]
        entry["crc32"] = crc32_of(group[entry["key"]])
        entry["file"] = names[entry["file"]]
    path = os.path.join(tmp_dir, f"index-rank{rank:05d}.json")
    try:
        with open(path, "w") as f:
            json.dump(index, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise OSError(write_failure(path, e)) from e


def merge_and_publish(ckpt_dir: str, tmp_dir: str, step: int, world: int, header: dict,
                      keep_last: int) -> str:  # fmt: skip
    """Rank 0: build metadata.json from the indexes, rename, update ``latest``, prune."""
    tensors: dict[str, TensorEntry] = {}
    for rank in range(world):
        path = os.path.join(tmp_dir, f"index-rank{rank:05d}.json")
        with open(path) as f:
            for e in json.load(f):
                entry = tensors.setdefault(e["name"], TensorEntry(e["shape"], e["dtype"]))
                entry.shards.append(Shard(e["file"], e["key"], e["offsets"], e["crc32"]))
        os.remove(path)
    meta = Metadata(format_version=FORMAT_VERSION, tensors=tensors, **header)
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


@dataclass(frozen=True)
class Saving:
    """What a Trainer's checkpoints record besides its own state: the RNG tracker whose streams
    they hold, the logging run id, and the tokenizer's special token ids (for exports)."""

    rng: RNGTracker | None = None
    run_id: str | None = None
    special_tokens: dict | None = None


class CheckpointSaver:
    """Periodic, final and asynchronous saves of a Trainer's state."""

    def __init__(self, cfg, trainer, rng=None, run_id: str | None = None,
                 special_tokens: dict | None = None):  # fmt: skip
        self.cfg, self.trainer, self.rng = cfg, trainer, rng
        self.special_tokens = dict(special_tokens or {})  # the tokenizer's, recorded for exports
        self.dir = os.path.expanduser(cfg.checkpoint.dir)
        self.run_id = run_id
        self.config_dict = OmegaConf.to_container(cfg, resolve=True)
        # The real vocabulary (the tokenizer's when model.vocab_size is null) for exports.
        self.config_dict["model"]["vocab_size"] = trainer.spec.vocab_size
        # (step, tmp dir, writer thread, metadata header, writer errors) of an unpublished save
        self.pending: tuple[int, str, threading.Thread, dict, list[str]] | None = None
        self.last_published: str | None = None

    def _header(self) -> dict:
        t, p = self.trainer, self.cfg.parallel
        return {
            "step": t.state.step,
            "consumed_samples": t.state.consumed_samples,
            "layout": {"tp": t.topo.tp, "cp": t.topo.cp, "pp": t.topo.pp, "dp": t.topo.dp,
                       "vpp": p.vpp, "ep": t.topo.ep,
                       "sp": bool(p.sp), "zero_stage": p.zero_stage,
                       "world_size": t.topo.world_size},  # fmt: skip
            "config": self.config_dict,
            "trainer": {"skipped_steps": t.state.skipped_steps,
                        "optimizer_steps": t.optimizer.step_count, "run_id": self.run_id},
            "tokenizer": self.special_tokens,
        }  # fmt: skip

    def save(self, blocking: bool | None = None) -> str | None:
        """Save the current step. Collective. Returns the published path (None while async)."""
        self.wait()
        topo, step = self.trainer.topo, self.trainer.state.step
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
        tensors, index = snapshot(self.trainer, self.rng)
        header = self._header()
        errors: list[str] = []

        def write() -> None:
            try:
                write_rank_files(tmp_dir, topo.rank, tensors, index)
            except Exception as e:  # noqa: BLE001 - reported on every rank by _publish
                errors.append(f"saving checkpoint step {step} failed: {e}")

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        self.pending = (step, tmp_dir, thread, header, errors)
        if blocking:
            return self.wait()
        return None

    def poll(self) -> str | None:
        """At a step boundary: publish a finished async save once every rank has written."""
        if self.pending is None:
            return None
        done = torch.tensor([0.0 if self.pending[2].is_alive() else 1.0])
        all_reduce(done, self.trainer.topo.world_group, op="min")
        return self._publish() if done.item() == 1.0 else None

    def wait(self) -> str | None:
        """Finish a pending save (every rank waits for its writer, then it is published)."""
        if self.pending is None:
            return None
        self.pending[2].join()
        return self._publish()

    def join_writer(self) -> None:
        """Wait until a background write has finished, without publishing it (a run that ends
        on an error leaves no thread writing files into the interpreter's exit)."""
        if self.pending is not None:
            self.pending[2].join()

    def _publish(self) -> str:
        step, tmp_dir, _, header, errors = self.pending
        self.pending = None
        topo = self.trainer.topo
        self._agree(errors[0] if errors else None, tmp_dir)  # every rank's files are on disk
        path, error = os.path.join(self.dir, step_dir_name(step)), None
        if topo.rank == 0:
            try:
                path = merge_and_publish(self.dir, tmp_dir, step, topo.world_size, header,
                                         self.cfg.checkpoint.keep_last)  # fmt: skip
            except OSError as e:
                error = f"publishing checkpoint step {step} failed: {e}"
        self._agree(error, tmp_dir)  # published before anyone reads it
        self.last_published = path
        return path

    def _agree(self, error: str | None, tmp_dir: str) -> None:
        """Collective: on any rank's failure, rank 0 removes the unpublished step and every rank
        raises :class:`CheckpointError` with the first failure and what is still published."""
        topo = self.trainer.topo
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
