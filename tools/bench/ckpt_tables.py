"""Summary numbers and tables of the checkpoint benchmark (from ``ckpt_rounds.rounds``)."""

from __future__ import annotations

from common import median
from sections import table

from megatronish.checkpoint.shard_reader import READ_THREADS

TARGET = 0.5  # save / load throughput as a fraction of the raw disk's
LOADS = ("load", "load 1 reader", "load verified", "load_file")  # read variants besides raw
OVERLAP = 0.5  # a step counts as "during the writer" when at least this much of it overlapped


def summarize(res: dict, nbytes: int) -> dict:
    """GB/s of each variant, ratios to raw (median of per-repeat ratios), async stall."""
    t = res["times"]
    saved = res["saved_bytes"]
    out: dict = {"bytes": nbytes, "gbps": {}, "best_gbps": {}, "ratio": {}}
    out["range_s"] = {name: [min(ts), max(ts)] for name, ts in t.items()}
    n = res["copies"]
    extra = n["piecewise copy"] - n["persistent copy"]
    out["copies"] = {**n, "per_copy_ms": {
        k: 1e3 * median([(a - b) / extra for a, b in zip(
            t[f"piecewise copy {k}"], t[f"persistent copy {k}"], strict=True)])
        for k in ("2t", "1t")
    }}  # fmt: skip
    for name, ts in t.items():
        if name != "async save":
            size = median(saved) if name == "save" else nbytes
            out["gbps"][name] = size / median(ts) / 1e9
            out["best_gbps"][name] = size / min(ts) / 1e9
    out["ratio"]["save"] = median([
        (b / s) / (nbytes / w) for b, s, w in zip(saved, t["save"], t["raw write"], strict=True)
    ])  # fmt: skip
    for cache in ("cold", "warm"):
        raw = t[f"raw read {cache}"]
        for name in LOADS:
            ratio = median([r / x for r, x in zip(raw, t[f"{name} {cache}"], strict=True)])
            out["ratio"][f"{name} {cache}"] = ratio
    a = res["async"]
    normal = [s for r in a for s in r["normal_steps_s"]]
    during = [s for r in a for s in r["steps_during_writer"] if s["overlap"] >= OVERLAP]
    if not during:  # steps longer than the writer: the first step of each async save
        during = [r["steps_during_writer"][0] for r in a if r["steps_during_writer"]]
    out["async"] = {
        "stall_s": median(t["async save"]),
        "snapshot_s": median([r["snapshot_s"] for r in a]),
        "publish_s": median([r["publish_s"] for r in a]),
        "writer_s": median([r["writer_s"] for r in a]),
        "blocking_s": median(t["save"]),
        "stall_fraction": median([x / s for x, s in zip(t["async save"], t["save"], strict=True)]),
        "normal_step_s": median(normal),
        "steps_during": len(during),
        "during_step_s": median([d["seconds"] for d in during]) if during else float("nan"),
        "during_overlap": median([d["overlap"] for d in during]) if during else float("nan"),
    }
    out["async"]["interference"] = out["async"]["during_step_s"] / out["async"]["normal_step_s"]
    return out


def _gb(s: dict, name: str) -> str:
    """Median GB/s (best repeat's GB/s)."""
    return f"{s['gbps'][name]:.3f} ({s['best_gbps'][name]:.3f})"


def throughput_table(s: dict) -> dict:
    r = s["ratio"]
    rows = [
        ["write", "(cold: written + fsync)", _gb(s, "raw write"), "save(blocking=True)",
         _gb(s, "save"), f"{r['save']:.0%}"],
    ]  # fmt: skip
    for cache in ("cold", "warm"):
        for name, what in (
            ("load", f"load_into (fresh trainer, verify=false), {READ_THREADS} reading threads"),
            ("load 1 reader", "load_into (verify=false), 1 reading thread"),
            ("load verified", "load_into + CRC32 of every shard (checkpoint.verify=true)"),
            ("load_file", "reference: safetensors load_file + 1 copy"),
        ):
            rows.append([
                "read", cache, _gb(s, f"raw read {cache}"), what,
                _gb(s, f"{name} {cache}"), f"{r[f'{name} {cache}']:.0%}",
            ])  # fmt: skip
    return table(
        f"Throughput (GB/s, {s['bytes'] / 1e6:.0f} MB per checkpoint; target >= {TARGET:.0%} "
        "of raw)",
        [
            "direction",
            "page cache",
            "raw disk GB/s (best)",
            "operation",
            "GB/s (best)",
            "of raw (median of per-repeat ratios)",
        ],  # fmt: skip
        rows,
    )


def async_table(s: dict) -> dict:
    a = s["async"]
    rows = [
        ["save(blocking=True), whole save", f"{a['blocking_s']:.3f}", "100%"],
        ["save(blocking=False) + publishing poll()", f"{a['stall_s']:.3f}",
         f"{a['stall_fraction']:.0%}"],
        ["  of which save(blocking=False) (snapshot to host memory)", f"{a['snapshot_s']:.3f}", ""],
        ["  of which the poll() that publishes", f"{a['publish_s']:.3f}", ""],
        ["background writer (not on the training thread)", f"{a['writer_s']:.3f}", ""],
    ]  # fmt: skip
    return table("Async save: training-thread stall at the step boundary (seconds)",
                 ["what", "seconds", "of blocking save"], rows)  # fmt: skip


def interference_table(s: dict) -> dict:
    a = s["async"]
    rows = [
        ["normal train_step", f"{a['normal_step_s']:.3f}", "1.00x"],
        [f"train_step while the writer runs ({a['steps_during']} steps, median "
         f"{a['during_overlap']:.0%} of each overlapped)",
         f"{a['during_step_s']:.3f}", f"{a['interference']:.2f}x"],
    ]  # fmt: skip
    return table("Async save: interference of the background writer with training",
                 ["step", "median seconds", "vs normal"], rows)  # fmt: skip


def profile_table(caption: str, wall: float, rows: list[dict]) -> dict:
    cells = [
        [r["where"], r["caller"], r["calls"], f"{r['own_s']:.3f}", f"{r['share']:.0%}"]
        for r in rows
    ]
    columns = ["function (own time)", "main caller", "calls", "own s", "of wall"]
    return table(f"{caption} (cProfile, {wall:.2f} s wall)", columns, cells)


def copies_table(s: dict) -> dict:
    """Host-memory copies at 2 vs 1 intra-op threads: GB/s (median seconds)."""
    g = s["gbps"]
    rows = []
    for name, what in (
        ("snapshot", "megatronish snapshot: 1 copy per piece into fresh memory"),
        ("piecewise copy", "control: 1 copy per piece into memory touched once"),
        ("persistent copy", "proposed: 1 copy per bucket and kind into memory touched once"),
    ):
        two, one = g[f"{name} 2t"], g[f"{name} 1t"]
        rows.append([what, f"{two:.2f}", f"{one:.2f}"])
    return table("Host-memory side (GB/s): the async-save snapshot vs the proposed persistent "
                 "buffers, at 2 and 1 intra-op threads",
                 ["operation", "2 threads GB/s", "1 thread GB/s"], rows)  # fmt: skip
