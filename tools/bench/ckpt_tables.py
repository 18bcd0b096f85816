"""Summary numbers and tables of the checkpoint benchmark (from ``ckpt_rounds.rounds``)."""

from __future__ import annotations

from common import median
from sections import table

TARGET = 0.5  # save / load throughput as a fraction of the raw disk's
OVERLAP = 0.5  # a step counts as "during the writer" when at least this much of it overlapped


def summarize(res: dict, nbytes: int) -> dict:
    """GB/s of each variant, ratios to raw (median of per-repeat ratios), async stall."""
    t = res["times"]
    saved = res["saved_bytes"]
    out: dict = {"bytes": nbytes, "gbps": {}, "ratio": {}}
    for name, ts in t.items():
        if name != "async save":
            size = median(saved) if name == "save" else nbytes
            out["gbps"][name] = size / median(ts) / 1e9
    out["ratio"]["save"] = median([
        (b / s) / (nbytes / w) for b, s, w in zip(saved, t["save"], t["raw write"], strict=True)
    ])  # fmt: skip
    for cache in ("cold", "warm"):
        raw = t[f"raw read {cache}"]
        for name in ("load", "load_file"):
            ratio = median([r / x for r, x in zip(raw, t[f"{name} {cache}"], strict=True)])
            out["ratio"][f"{name} {cache}"] = ratio
    a = res["async"]
    normal = [s for r in a for s in r["normal_steps_s"]]
    during = [s["seconds"] for r in a for s in r["steps_during_writer"] if s["overlap"] >= OVERLAP]
    out["async"] = {
        "stall_s": median(t["async save"]),
        "snapshot_s": median([r["snapshot_s"] for r in a]),
        "publish_s": median([r["publish_s"] for r in a]),
        "writer_s": median([r["writer_s"] for r in a]),
        "blocking_s": median(t["save"]),
        "stall_fraction": median([x / s for x, s in zip(t["async save"], t["save"], strict=True)]),
        "normal_step_s": median(normal),
        "steps_during": len(during),
        "during_step_s": median(during) if during else float("nan"),
    }
    out["async"]["interference"] = out["async"]["during_step_s"] / out["async"]["normal_step_s"]
    return out


def _gb(x: float) -> str:
    return f"{x:.3f}"


def throughput_table(s: dict) -> dict:
    g, r = s["gbps"], s["ratio"]
    rows = [
        ["write", "(cold: written + fsync)", _gb(g["raw write"]), "save(blocking=True)",
         _gb(g["save"]), f"{r['save']:.0%}"],
    ]  # fmt: skip
    for cache in ("cold", "warm"):
        for name, what in (("load", "load_into (fresh trainer)"), ("load_file", "load_file")):
            rows.append([
                "read", cache, _gb(g[f"raw read {cache}"]), what,
                _gb(g[f"{name} {cache}"]), f"{r[f'{name} {cache}']:.0%}",
            ])  # fmt: skip
    return table(
        f"Throughput (GB/s, {s['bytes'] / 1e6:.0f} MB per checkpoint; target >= {TARGET:.0%} "
        "of raw)",
        ["direction", "page cache", "raw disk GB/s", "operation", "GB/s", "of raw"],
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
        [f"train_step while the writer runs ({a['steps_during']} steps)",
         f"{a['during_step_s']:.3f}", f"{a['interference']:.2f}x"],
    ]  # fmt: skip
    return table("Async save: interference of the background writer with training",
                 ["step", "median seconds", "vs normal"], rows)  # fmt: skip


def profile_table(caption: str, wall: float, rows: list[dict]) -> dict:
    cells = [
        [r["where"], r["caller"], r["calls"], f"{r['own_s']:.3f}", f"{r['share']:.0%}"]
        for r in rows
    ]
    return table(f"{caption} (cProfile, {wall:.2f} s wall)",
                 ["function (own time)", "main caller", "calls", "own s", "of wall"], cells)  # fmt: skip
