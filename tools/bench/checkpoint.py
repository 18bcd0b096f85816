"""Checkpoint save / load throughput against the raw disk, and the cost of async saves.
Run alone: ``.venv/bin/python tools/bench/checkpoint.py [--quick] [--profile] [--dir D]``.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import shutil
import tempfile
import time
import zlib

import torch
from common import build_run, cli, median, table, threads
from safetensors.torch import load_file

import megatronish.checkpoint.save as save_mod
from megatronish.checkpoint.load import load_into
from megatronish.checkpoint.pieces import full_local_values, param_rects
from megatronish.checkpoint.save import CheckpointSaver, merge_and_publish
from megatronish.checkpoint.shard_reader import READ_THREADS
from megatronish.checkpoint.snapshot import snapshot

# ~27.8M params: 333 MB of fp32 params + 2 Adam moments. Short sequences keep a step short, so
# several steps run during one background write.
MODEL = [
    "model.hidden_size=512",
    "model.num_layers=8",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=1408",
    "model.seq_length=64",
    "trainer.micro_batch_size=1",
    "trainer.global_batch_size=1",
    "checkpoint.keep_last=null",  # the bench removes old steps itself, outside the timings
]
CHUNK = 16 << 20  # bytes per raw write / read call
TARGET = 0.5  # save / load throughput as a fraction of the raw disk's
OVERLAP = 0.5  # a step counts as "during the writer" when at least this much of it overlapped
WRITES = ("raw write", "save", "async save")
READS = ("raw read", "load", "load 1 reader", "load verified", "load_file")
COPIES = ("snapshot", "piecewise copy", "persistent copy")  # each at 2 and 1 intra-op threads
WRITE_RANK_FILES = save_mod.write_rank_files


def dir_files(path: str) -> list[str]:
    names = sorted(os.listdir(path))
    return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]


def evict(paths: list[str]) -> None:
    """Drop the page-cache pages of ``paths`` (fsynced first, so they are clean and dropped)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def raw_write(path: str, nbytes: int, data: memoryview) -> None:
    """Write ``nbytes`` to a new file in ``CHUNK`` writes, then fsync."""
    with open(path, "wb") as f:
        for pos in range(0, nbytes, len(data)):
            f.write(data[: min(len(data), nbytes - pos)])
        f.flush()
        os.fsync(f.fileno())


def raw_read(path: str, out: memoryview) -> None:
    """Read the file into ``out`` (preallocated and touched) in ``CHUNK`` reads."""
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while n := f.readinto(out[pos : pos + CHUNK]):
            pos += n


def load_file_copy(files: list[str], dest: torch.Tensor) -> None:
    """safetensors ``load_file`` with every tensor copied once into ``dest`` (the copy reads)."""
    pos = 0
    for f in (f for f in files if f.endswith(".safetensors")):
        for t in load_file(f).values():
            flat = t.reshape(-1).view(torch.uint8)
            dest[pos : pos + flat.numel()].copy_(flat)
            pos += flat.numel()


class Rig:
    """The trainer that saves (2 steps trained, so Adam's moments are nonzero), its saver, a
    fresh trainer to load into, and when each background writer ended."""

    def __init__(self, ckpt_dir: str):
        overrides = [*MODEL, f"checkpoint.dir={ckpt_dir}"]
        self.run, self.fresh, self.dir = build_run(overrides), build_run(overrides), ckpt_dir
        for _ in range(2):
            self.run.step()
        self.saver = CheckpointSaver(self.run.cfg, self.run.trainer.checkpoint_parts)
        self.writer_ends: list[float] = []

        def recorded(*args, **kwargs):
            try:
                return WRITE_RANK_FILES(*args, **kwargs)
            finally:
                self.writer_ends.append(time.perf_counter())

        save_mod.write_rank_files = recorded

    def save(self) -> tuple[float, str]:
        t0 = time.perf_counter()
        path = self.saver.save(blocking=True)
        return time.perf_counter() - t0, path

    def load(self, path: str, verify: bool = False, threads: int = READ_THREADS) -> float:
        self.fresh.trainer.cfg.checkpoint.verify = verify
        return timed(load_into, self.fresh.trainer.checkpoint_parts, path, threads=threads)

    def step(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.run.step()
        return t0, time.perf_counter()

    def async_round(self, baseline_steps: int) -> dict:
        """Normal steps, then ``save(blocking=False)`` with steps until its writer ends and the
        ``poll()`` that publishes; each step during the writer with its overlapped fraction."""
        normal = [end - start for start, end in (self.step() for _ in range(baseline_steps))]
        t0 = time.perf_counter()
        self.saver.save(blocking=False)
        t1 = time.perf_counter()
        thread, steps = self.saver.pending[2], []
        while thread.is_alive():
            steps.append(self.step())
        thread.join()
        t2 = time.perf_counter()
        path = self.saver.poll()
        publish, end = time.perf_counter() - t2, self.writer_ends[-1]
        during = [
            {"seconds": e - s, "overlap": max(0.0, min(e, end) - s) / (e - s)} for s, e in steps
        ]
        return {
            "normal_steps_s": normal,
            "snapshot_s": t1 - t0,
            "publish_s": publish,
            "writer_s": end - t1,
            "steps_during_writer": during,
            "path": path,
        }


class PersistentCopy:
    """The proposed snapshot: one ``copy_`` per bucket and kind into host buffers allocated and
    touched once; ``piecewise`` copies the same bytes one piece at a time, as ``snapshot`` does."""

    def __init__(self, rig: Rig):
        t = rig.run.trainer
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, bucket in enumerate(t.zero.buckets):
            for src in full_local_values(t.zero, t.optimizer, i, bucket):
                dst = torch.ones_like(src, device="cpu")
                self.pairs.append((dst, src))
                for (_, p), offset in zip(bucket.params, bucket.offsets, strict=True):
                    span = slice(offset, offset + p.numel())
                    for rect in param_rects(p, t.topo.coords.tp, t.topo.tp):
                        pair = (dst[span].view(p.shape), src[span].view(p.shape))
                        self.pieces.append((rect.take(pair[0]), rect.take(pair[1])))

    def copy(self, piecewise: bool = False) -> None:
        for dst, src in self.pieces if piecewise else self.pairs:
            dst.copy_(src)


def remove(path: str | None) -> None:
    if path and os.path.isdir(path):
        shutil.rmtree(path)


def rounds(rig: Rig, nbytes: int, repeats: int, baseline_steps: int) -> dict:
    """Every repeat: the writes, cold and warm reads of what it wrote, a CRC32 pass in memory,
    the host copies at 2 and 1 threads; the order reversed every other repeat."""
    data = memoryview(torch.randn(CHUNK // 4).numpy()).cast("B")  # incompressible
    buf = memoryview(torch.ones(nbytes + (1 << 20), dtype=torch.uint8).numpy()).cast("B")
    dest, persistent = torch.frombuffer(buf, dtype=torch.uint8), PersistentCopy(rig)
    raw = os.path.join(rig.dir, "raw.bin")
    times: dict[str, list[float]] = {}
    saved_bytes, asyncs = [], []
    for r in range(repeats):
        order = (lambda xs: list(reversed(xs))) if r % 2 else list
        out, ckpt = {}, None
        for name in order(WRITES):
            if name == "raw write":
                out[name] = timed(raw_write, raw, nbytes, data)
            elif name == "save":
                out[name], ckpt = rig.save()
                saved_bytes.append(sum(os.path.getsize(f) for f in dir_files(ckpt)))
            else:
                asyncs.append(rig.async_round(baseline_steps))
                remove(asyncs[-1].pop("path"))
                out[name] = asyncs[-1]["snapshot_s"] + asyncs[-1]["publish_s"]
        files = dir_files(ckpt)
        reads = {
            "raw read": ([raw], lambda: timed(raw_read, raw, buf)),
            "load": (files, lambda c=ckpt: rig.load(c)),
            "load 1 reader": (files, lambda c=ckpt: rig.load(c, threads=1)),
            "load verified": (files, lambda c=ckpt: rig.load(c, verify=True)),
            "load_file": (files, lambda f=files: timed(load_file_copy, f, dest)),
        }
        for cache in order(["cold", "warm"]):
            for name in order(READS):
                paths, op = reads[name]
                if cache == "cold":
                    evict(paths)
                else:
                    for p in paths:
                        raw_read(p, buf)
                out[f"{name} {cache}"] = op()
        out["crc32"] = timed(zlib.crc32, buf[:nbytes])
        copies = {
            "snapshot": lambda: timed(snapshot, rig.run.trainer, None),
            "piecewise copy": lambda: timed(persistent.copy, piecewise=True),
            "persistent copy": lambda: timed(persistent.copy),
        }
        for n in order([2, 1]):
            with threads(n):
                for name in order(COPIES):
                    out[f"{name} {n}t"] = copies[name]()
        for name, seconds in out.items():
            times.setdefault(name, []).append(seconds)
        remove(ckpt)
        os.remove(raw)
    counts = {"piecewise copy": len(persistent.pieces), "persistent copy": len(persistent.pairs)}
    return {"times": times, "saved_bytes": saved_bytes, "async": asyncs, "copies": counts}


def summarize(res: dict, nbytes: int) -> dict:
    """GB/s of each variant, ratios to raw (medians of per-repeat ratios), the async stall."""
    t, saved, a, n = res["times"], res["saved_bytes"], res["async"], res["copies"]
    size = {name: median(saved) if name == "save" else nbytes for name in t}
    out: dict = {
        "bytes": nbytes,
        "range_s": {k: [min(ts), max(ts)] for k, ts in t.items()},
        "gbps": {k: size[k] / median(ts) / 1e9 for k, ts in t.items()},
        "best_gbps": {k: size[k] / min(ts) / 1e9 for k, ts in t.items()},
    }
    del out["gbps"]["async save"], out["best_gbps"]["async save"]
    extra = n["piecewise copy"] - n["persistent copy"]
    pairs = {
        k: zip(t[f"piecewise copy {k}"], t[f"persistent copy {k}"], strict=True)
        for k in ("2t", "1t")
    }
    per_copy = {k: 1e3 * median([(p - q) / extra for p, q in v]) for k, v in pairs.items()}
    out["copies"] = {**n, "per_copy_ms": per_copy}
    writes = zip(saved, t["save"], t["raw write"], strict=True)
    out["ratio"] = {"save": median([(b / s) / (nbytes / w) for b, s, w in writes])}
    for cache in ("cold", "warm"):
        for name in READS[1:]:
            pairs = zip(t[f"raw read {cache}"], t[f"{name} {cache}"], strict=True)
            out["ratio"][f"{name} {cache}"] = median([r / x for r, x in pairs])
    during = [s for r in a for s in r["steps_during_writer"] if s["overlap"] >= OVERLAP]
    if not during:  # steps longer than the writer: the first step of each async save
        during = [r["steps_during_writer"][0] for r in a if r["steps_during_writer"]]
    nan = float("nan")
    out["async"] = {
        "stall_s": median(t["async save"]),
        "blocking_s": median(t["save"]),
        **{k: median([r[k] for r in a]) for k in ("snapshot_s", "publish_s", "writer_s")},
        "stall_fraction": median([x / s for x, s in zip(t["async save"], t["save"], strict=True)]),
        "normal_step_s": median([s for r in a for s in r["normal_steps_s"]]),
        "normal_steps": sum(len(r["normal_steps_s"]) for r in a),
        "steps_during": len(during),
        "during_step_s": median([d["seconds"] for d in during]) if during else nan,
        "during_overlap": median([d["overlap"] for d in during]) if during else nan,
    }
    out["async"]["interference"] = out["async"]["during_step_s"] / out["async"]["normal_step_s"]
    return out


def profiles(rig: Rig) -> dict:
    """cProfile of one save, as the three parts the saver runs called in the main thread (the
    writer thread is invisible to cProfile), and of one cold load with 1 reader, no checksums:
    wall seconds and the 8 entries with the most own time, each with its main caller."""
    trainer, step = rig.run.trainer, rig.run.trainer.state.step
    tmp = os.path.join(rig.dir, f".tmp_profile_{step:07d}")
    os.makedirs(tmp)
    parts, published, out = {}, [], {}

    def save() -> None:
        t0 = time.perf_counter()
        tensors, index = snapshot(trainer.checkpoint_parts)
        t1 = time.perf_counter()
        WRITE_RANK_FILES(tmp, 0, tensors, index)
        t2 = time.perf_counter()
        published.append(merge_and_publish(rig.dir, tmp, step, 1, rig.saver._header(), 0))
        parts.update(snapshot=t1 - t0, write=t2 - t1, publish=time.perf_counter() - t2)

    def load() -> None:
        load_into(rig.fresh.trainer.checkpoint_parts, published[0], threads=1)

    def where(key) -> str:
        return key[2] if key[0] == "~" else f"{os.path.basename(key[0])}:{key[1]}({key[2]})"

    for kind, fn in (("save", save), ("load", load)):
        if kind == "load":
            evict(dir_files(published[0]))
            rig.fresh.trainer.cfg.checkpoint.verify = False
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        fn()
        prof.disable()
        wall = time.perf_counter() - t0
        top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: kv[1][2], reverse=True)[:8]
        out[kind] = {
            "wall_s": wall,
            "rows": [
                {
                    "where": where(key),
                    "caller": where(max(callers.items(), key=lambda kv: kv[1][2])[0])
                    if callers
                    else "",
                    "calls": calls,
                    "own_s": own,
                    "cum_s": cum,
                    "share": own / wall,
                }
                for key, (_, calls, own, cum, callers) in top
            ],
        }
    remove(published[0])
    return {**out, "save_parts_s": parts}


def filesystem(path: str) -> str:
    """``device (fstype)`` of the mount holding ``path``."""
    with open("/proc/mounts") as f:
        mounts = [line.split()[:3] for line in f if path.startswith(line.split()[1])]
    dev, _, fstype = max(mounts, key=lambda m: len(m[1]), default=("?", "", "?"))
    return f"{dev} ({fstype})"


def run(quick: bool = False, profile: bool = False, base: str | None = None) -> dict:
    repeats, baseline_steps = (3, 1) if quick else (5, 2)
    work = tempfile.mkdtemp(prefix="megatronish-ckpt-bench-", dir=base)
    try:
        rig = Rig(work)
        _, path = rig.save()  # warm-up: first-call costs
        nbytes = sum(os.path.getsize(f) for f in dir_files(path))
        rig.load(path)
        remove(path)
        res = rounds(rig, nbytes, repeats, baseline_steps)
        s = summarize(res, nbytes)
        r, g, best, a, c = s["ratio"], s["gbps"], s["best_gbps"], s["async"], s["copies"]
        below = min(r["save"], r["load cold"], r["load warm"]) < TARGET
        prof = profiles(rig) if profile or below else None
        params = sum(p.numel() for c in rig.run.chunks for p in c.parameters())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ops = [("write", "cold (written + fsync)", "save", "raw write")] + [
        ("read", c, n, f"raw read {c}") for c in ("cold", "warm") for n in READS[1:]
    ]
    sec = {k: nbytes / 1e9 / v for k, v in g.items()}
    tables = [
        table(
            f"Throughput, GB/s (a checkpoint is {nbytes / 1e6:.0f} MB)",
            [
                "direction",
                "page cache",
                "operation",
                "GB/s|.3f",
                "best repeat|.3f",
                "raw disk GB/s|.3f",
                "raw, best repeat|.3f",
                "of raw (median of per-repeat ratios)|.0%",
                f"target >= {TARGET:.0%} of raw met",
            ],
            [
                [d, cache, op, g[k], best[k], g[raw], best[raw], r[k], r[k] >= TARGET]
                for d, cache, op, raw in ops
                for k in [op if d == "write" else f"{op} {cache}"]
            ],
        ),
        table(
            "Async save: training-thread stall at the step boundary",
            ["what", "seconds|.3f", "of blocking save|.0%"],
            [
                ["save(blocking=True)", a["blocking_s"], 1.0],
                ["save(blocking=False) + the publishing poll()", a["stall_s"], a["stall_fraction"]],
                ["of which save(blocking=False)", a["snapshot_s"], None],
                ["of which poll()", a["publish_s"], None],
                ["background writer", a["writer_s"], None],
            ],
        ),
        table(
            "Async save: interference of the background writer with training",
            [
                "train_step",
                "steps",
                "median seconds|.3f",
                "overlapped by the writer|.0%",
                "vs normal|.2fx",
            ],
            [
                ["normal", a["normal_steps"], a["normal_step_s"], None, 1.0],
                [
                    "while the writer runs",
                    a["steps_during"],
                    a["during_step_s"],
                    a["during_overlap"],
                    a["interference"],
                ],
            ],
        ),
        table(
            "Host-memory copies of the checkpoint's bytes at 2 and 1 intra-op threads",
            [
                "copy",
                "copies",
                "2 threads GB/s|.2f",
                "1 thread GB/s|.2f",
                "2 threads, fastest / slowest s|.2f",
                "1 thread, fastest / slowest s|.2f",
            ],
            [
                [
                    n,
                    c[n if n != "snapshot" else "piecewise copy"],
                    g[f"{n} 2t"],
                    g[f"{n} 1t"],
                    s["range_s"][f"{n} 2t"],
                    s["range_s"][f"{n} 1t"],
                ]
                for n in COPIES
            ],
        ),
    ]
    facts = {
        "checkpoint": f"{params / 1e6:.1f}M params, {nbytes / 1e6:.0f} MB",
        "scratch directory on": filesystem(work),
        "CRC32 (zlib, one thread, in memory), GB/s|.2f": g["crc32"],
        "checksums add to a load, cold / warm, s|.3f": [
            sec[f"load verified {k}"] - sec[f"load {k}"] for k in ("cold", "warm")
        ],
        "snapshot at 2 threads: fresh memory (page faults) costs, s|.2f": sec["snapshot 2t"]
        - sec["piecewise copy 2t"],
        "snapshot at 2 threads: the number of copies costs, s|.2f": sec["piecewise copy 2t"]
        - sec["persistent copy 2t"],
        "ms per extra copy at 2 / 1 threads|.3f": list(c["per_copy_ms"].values()),
    }
    if prof is not None:
        for kind, caption in (("save", "Where a save goes"), ("load", "Where a cold load goes")):
            tables.append(
                table(
                    f"{caption} (cProfile, {prof[kind]['wall_s']:.2f} s wall)",
                    ["function (own time)", "main caller", "calls", "own s|.3f", "of wall|.0%"],
                    [
                        [x["where"], x["caller"], x["calls"], x["own_s"], x["share"]]
                        for x in prof[kind]["rows"]
                    ],
                )
            )
        facts["save parts: snapshot / write / publish, s|.2f"] = [*prof["save_parts_s"].values()]
    return {
        "title": "Checkpoint save / load throughput vs the raw disk, async save stall",
        "config": {
            "repeats": repeats,
            "baseline_steps": baseline_steps,
            "model": MODEL,
            "threads": torch.get_num_threads(),
            "read_threads": READ_THREADS,
        },
        "results": {"summary": s, "rounds": res, "profile": prof, "params": params},
        "tables": tables,
        "facts": facts,
    }


if __name__ == "__main__":
    cli(
        run,
        __doc__,
        ("--profile", {"action": "store_true", "help": "profile even when on target"}),
        ("--dir", {"dest": "base", "help": "parent of the scratch directory (tmp)"}),
    )
