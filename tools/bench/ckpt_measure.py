"""megatronish's side of the checkpoint benchmark: save, load, async stall and interference.

A :class:`CkptRig` holds a trained Trainer with its :class:`CheckpointSaver` and a second,
freshly built Trainer of the same layout to load into. Every function returns seconds of one
operation; published step directories are removed by the caller, outside the timings.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

import torch
from mish import MishRun, build_run
from safetensors.torch import load_file

import megatronish.checkpoint.save as save_mod
from megatronish.checkpoint.load import load_into
from megatronish.checkpoint.pieces import full_local_values, param_rects
from megatronish.checkpoint.save import CheckpointSaver, snapshot
from megatronish.checkpoint.shard_reader import READ_THREADS

# ~27.8M params: 333 MB of fp32 params + 2 Adam moments. Short sequences keep a step short
# (~0.25 s on a quiet machine), so several steps run during one background write.
MODEL = [
    "model.hidden_size=512", "model.num_layers=8", "model.num_attention_heads=8",
    "model.num_query_groups=4", "model.ffn_hidden_size=1408", "model.seq_length=64",
    "trainer.micro_batch_size=1", "trainer.global_batch_size=1",
    "checkpoint.keep_last=null",  # the bench removes old steps itself, outside the timings
]  # fmt: skip
MODEL_TEXT = (
    "llama, 8 layers, hidden 512, 8 heads, 4 kv heads, ffn 1408, vocab 4096, seq 64, batch 1"
)


@dataclass
class CkptRig:
    """The trainer that saves, its saver, and a fresh trainer that loads."""

    run: MishRun
    fresh: MishRun
    saver: CheckpointSaver
    dir: str
    writer_ends: list[float] = field(default_factory=list)  # perf_counter at each writer's end

    @property
    def params(self) -> int:
        return sum(p.numel() for c in self.run.chunks for p in c.parameters())


def build_rig(ckpt_dir: str) -> CkptRig:
    """Build both trainers (one process) and take 2 steps so Adam's moments are nonzero."""
    overrides = [*MODEL, f"checkpoint.dir={ckpt_dir}"]
    run, fresh = build_run(overrides), build_run(overrides)
    for _ in range(2):
        run.step()
    rig = CkptRig(run, fresh, CheckpointSaver(run.cfg, run.trainer), ckpt_dir)
    _record_writer_ends(rig)
    return rig


def _record_writer_ends(rig: CkptRig) -> None:
    """Note when each background writer finishes (wraps the module's writer function)."""
    original = save_mod.write_rank_files

    def write_rank_files(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            rig.writer_ends.append(time.perf_counter())

    save_mod.write_rank_files = write_rank_files


def timed_save(rig: CkptRig) -> tuple[float, str]:
    """Seconds of ``save(blocking=True)`` and the published step directory."""
    t0 = time.perf_counter()
    path = rig.saver.save(blocking=True)
    return time.perf_counter() - t0, path


def timed_load(rig: CkptRig, path: str, verify: bool = False, threads: int = READ_THREADS) -> float:
    """Seconds of ``load_into`` of ``path`` into the fresh trainer, with ``checkpoint.verify``
    set to ``verify`` and ``threads`` reading threads."""
    rig.fresh.trainer.cfg.checkpoint.verify = verify
    t0 = time.perf_counter()
    load_into(rig.fresh.trainer, path, threads=threads)
    return time.perf_counter() - t0


def timed_load_file(files: list[str], dest: torch.Tensor) -> float:
    """Seconds to ``safetensors.torch.load_file`` ``files`` and copy every tensor once into
    ``dest`` (a preallocated uint8 buffer): the floor of a loader that reads through safetensors
    (``load_file`` alone only maps the file; the copy is what reads it)."""
    t0 = time.perf_counter()
    pos = 0
    for f in files:
        if not f.endswith(".safetensors"):
            continue
        for t in load_file(f).values():
            flat = t.reshape(-1).view(torch.uint8)
            dest[pos : pos + flat.numel()].copy_(flat)
            pos += flat.numel()
    return time.perf_counter() - t0


def timed_snapshot(rig: CkptRig) -> float:
    """Seconds of megatronish's ``snapshot`` (what ``save(blocking=False)`` stalls on)."""
    t0 = time.perf_counter()
    snapshot(rig.run.trainer, None)
    return time.perf_counter() - t0


class PersistentCopy:
    """The proposed snapshot: one ``copy_`` per bucket and kind into host buffers allocated and
    touched once (the same bytes as megatronish's snapshot at ZeRO 0). ``piecewise`` copies the
    same bytes one piece (parameter or fused block) at a time, as the snapshot does, which
    separates the cost of fresh memory from the cost per copy."""

    def __init__(self, rig: CkptRig):
        t = rig.run.trainer
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, bucket in enumerate(t.zero.buckets):
            for src in full_local_values(t.zero, t.optimizer, i, bucket):
                dst = torch.ones_like(src, device="cpu")
                self.pairs.append((dst, src))
                for (_, p), offset in zip(bucket.params, bucket.offsets, strict=True):
                    span = slice(offset, offset + p.numel())
                    for rect in param_rects(p, t.topo.coords.tp, t.topo.tp):  # as snapshot
                        pair = (dst[span].view(p.shape), src[span].view(p.shape))
                        self.pieces.append((rect.take(pair[0]), rect.take(pair[1])))

    def timed(self, piecewise: bool = False) -> float:
        t0 = time.perf_counter()
        for dst, src in self.pieces if piecewise else self.pairs:
            dst.copy_(src)
        return time.perf_counter() - t0


def timed_step(rig: CkptRig) -> tuple[float, float]:
    """Start and end (perf_counter) of one training step."""
    t0 = time.perf_counter()
    rig.run.step()
    return t0, time.perf_counter()


def async_round(rig: CkptRig, baseline_steps: int) -> dict:
    """Normal steps, then an async save with steps running while its writer works.

    Returns the normal step times, the step-boundary stall (``save(blocking=False)``, and the
    ``poll()`` that publishes once the writer is done), the writer's duration, and each step
    that started while the writer ran with the fraction of it that overlapped the writer.
    """
    normal = [end - start for start, end in (timed_step(rig) for _ in range(baseline_steps))]
    t0 = time.perf_counter()
    rig.saver.save(blocking=False)
    t1 = time.perf_counter()
    thread = rig.saver.pending[2]
    steps = []
    while thread.is_alive():
        steps.append(timed_step(rig))
    thread.join()
    t2 = time.perf_counter()
    path = rig.saver.poll()
    publish = time.perf_counter() - t2
    writer_end = rig.writer_ends[-1]
    during = [
        {"seconds": e - s, "overlap": max(0.0, min(e, writer_end) - s) / (e - s)} for s, e in steps
    ]
    return {
        "normal_steps_s": normal,
        "snapshot_s": t1 - t0,
        "publish_s": publish,
        "writer_s": writer_end - t1,
        "steps_during_writer": during,
        "path": path,
    }


def remove(path: str | None) -> None:
    """Delete a published step (and ``latest``), so the next save starts from the same state."""
    if path and os.path.isdir(path):
        shutil.rmtree(path)
