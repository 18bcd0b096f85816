"""The notes of the checkpoint section: what the numbers say, where time goes, proposed fixes.

The save fix is a proposal for ``megatronish/checkpoint`` (this benchmark does not change it); it
follows from the structure of the code, and the profile shares quoted next to it are measured.
"""

from __future__ import annotations

import os

from ckpt_tables import TARGET

from megatronish.checkpoint.shard_reader import READ_THREADS

LOAD_PATH = (
    "How `load_into` reads (megatronish/checkpoint/shardfile.py): each safetensors header gives "
    "every tensor's byte range; a rectangle that is one run of bytes (a whole shard, or rows of "
    "it) is read with `preadv` straight into its place in `param_flat` / `exp_avg` / "
    "`exp_avg_sq` (one kernel copy, no mapped pages, no temporaries, no intra-op threads), "
    "also the part of a parameter that a ZeRO range cuts; a tp-sliced rectangle or another "
    "dtype or device goes through a reused staging buffer, a slab of rows at a time. All the "
    f"pieces of a load are read in file order, split into {READ_THREADS} runs of about equal "
    "bytes read by as many threads; with `checkpoint.verify` each shard's CRC32 is computed "
    "where it was read, by the thread that read it."
)
SAVE_FIX = (
    "Proposed save / async-stall fix: `snapshot` copies each piece with "
    "`.to('cpu', copy=True)` into newly allocated memory on every save, so the training thread "
    "pays one intra-op parallel copy per piece (3 per parameter) plus first-touch page faults. "
    "Keep persistent host buffers (one per bucket and kind, allocated and touched once; saves "
    "are already serialised by `wait()`), copy the three flats into them with one `copy_` each "
    "and hand views of them to the writer. CRC32 and fsync already run on the writer thread."
)


def _share(rows: list[dict], needle: str) -> float:
    return sum(r["share"] for r in rows if needle in r["where"])


def _verdict(ratio: float) -> str:
    return "on target" if ratio >= TARGET else f"BELOW the {TARGET:.0%} target"


def _memory_note(s: dict) -> str:
    """Fresh memory vs number of copies, 2 vs 1 threads (from the interleaved repeats)."""
    g, spread, c = s["gbps"], s["range_s"], s["copies"]
    two, one = spread["snapshot 2t"], spread["snapshot 1t"]
    per = c["per_copy_ms"]
    sec = {k: s["bytes"] / v / 1e9 for k, v in g.items()}
    fresh = sec["snapshot 2t"] - sec["piecewise copy 2t"]
    many = sec["piecewise copy 2t"] - sec["persistent copy 2t"]
    return (
        f"Host memory (GB/s at 2 / 1 intra-op threads): megatronish's snapshot, "
        f"{c['piecewise copy']} copies into fresh memory, {g['snapshot 2t']:.2f} / "
        f"{g['snapshot 1t']:.2f}; the same {c['piecewise copy']} copies into memory touched "
        f"once {g['piecewise copy 2t']:.2f} / {g['piecewise copy 1t']:.2f}; the proposed "
        f"{c['persistent copy']} bucket-sized copies into memory touched once "
        f"{g['persistent copy 2t']:.2f} / {g['persistent copy 1t']:.2f}. So at 2 threads "
        f"fresh memory (page faults) costs {fresh:.2f} s per snapshot and the number of copies "
        f"{many:.2f} s ({per['2t']:.2f} ms per extra copy, {max(per['1t'], 0.0):.3f} ms at 1 "
        "thread). A copy is an OpenMP parallel region whose second thread must get the other "
        "core, which other processes keep busy on this shared machine (one snapshot took "
        f"{two[0]:.2f}-{two[1]:.2f} s at 2 threads over the repeats, {one[0]:.2f}-{one[1]:.2f} s "
        "at 1)."
    )


def _verify_note(s: dict) -> str:
    """What checking every shard's CRC32 on load costs."""
    g, r = s["gbps"], s["ratio"]
    gb = s["bytes"] / 1e9
    extra = {c: gb / g[f"load verified {c}"] - gb / g[f"load {c}"] for c in ("cold", "warm")}
    return (
        "Load checking every shard's CRC32 (`checkpoint.verify=true`, the default): cold "
        f"{g['load verified cold']:.3f} GB/s = {r['load verified cold']:.0%} of the raw read, "
        f"warm {g['load verified warm']:.3f} GB/s = {r['load verified warm']:.0%}: the checksums "
        f"add {extra['cold']:.3f} s (cold) and {extra['warm']:.3f} s (warm) to a load of "
        f"{s['bytes'] / 1e6:.0f} MB. zlib's CRC32 alone runs at {g['crc32']:.2f} GB/s on one "
        f"thread here (one pass over the bytes in memory), against a raw read of "
        f"{g['raw read warm']:.2f} GB/s from the page cache, so a checked load is bounded by the "
        f"checksum (spread over {READ_THREADS} reading threads); `checkpoint.verify=false` "
        "loads at the unchecked speed."
    )


def findings(s: dict, prof: dict | None, load: float | None = None) -> list[str]:
    """Sentences under the tables (``load``: the 1-minute load average, default now)."""
    g, r, a = s["gbps"], s["ratio"], s["async"]
    to = "method 'to'"
    notes = [
        f"Save: {g['save']:.3f} GB/s = {r['save']:.0%} of the raw sequential write "
        f"({g['raw write']:.3f} GB/s), {_verdict(r['save'])}.",
        f"Load (`load_into`, {READ_THREADS} reading threads, no checksums): cold "
        f"{g['load cold']:.3f} GB/s = {r['load cold']:.0%} of the raw read "
        f"({g['raw read cold']:.3f} GB/s), {_verdict(r['load cold'])}; warm "
        f"{g['load warm']:.3f} GB/s = {r['load warm']:.0%} of the raw read "
        f"({g['raw read warm']:.3f} GB/s), {_verdict(r['load warm'])}. With one reading thread: "
        f"{r['load 1 reader cold']:.0%} (cold) and {r['load 1 reader warm']:.0%} (warm). "
        f"Reading the same files through safetensors with one copy: "
        f"{r['load_file cold']:.0%} and {r['load_file warm']:.0%}.",
        _verify_note(s),
        LOAD_PATH,
        f"Async save stalls the training thread for {a['stall_s']:.3f} s "
        f"({a['stall_fraction']:.0%} of a blocking save's {a['blocking_s']:.3f} s): "
        f"{a['snapshot_s']:.3f} s in `save(blocking=False)` (the snapshot to host memory) and "
        f"{a['publish_s']:.3f} s in the `poll()` that publishes; the writer then works "
        f"{a['writer_s']:.3f} s in the background.",
        f"Steps while the writer runs take {a['interference']:.2f}x a normal step "
        f"({a['during_step_s']:.3f} vs {a['normal_step_s']:.3f} s)"
        + (
            ": the writer thread (safetensors serialisation into the page cache, CRC32 of every "
            "piece) takes CPU from the step's 2 intra-op threads on 2 shared cores."
            if a["interference"] >= 1.1
            else ": no slowdown that stands out from the noise of the shared machine (the "
            "writer spends much of its time in fsync, waiting on the disk)."
        ),
        _memory_note(s),
    ]
    if prof is not None:
        load_rows, save_rows = prof["load"]["rows"], prof["save"]["rows"]
        parts = prof["save"]["parts_s"]
        preadv = _share(load_rows, "preadv")
        other = next((r for r in load_rows if "preadv" not in r["where"]), None)
        notes.append(
            f"Cold load profile (one sample, 1 reading thread, no checksums): {preadv:.0%} of "
            "the wall in `preadv` (the kernel copying file pages into the ZeRO buffers, waiting "
            "on the disk included)"
            + (f"; next: {other['where']} {other['share']:.0%}." if other else ".")
        )
        total = sum(parts.values())
        notes.append(
            "Save profile (one sample; parts run in the main thread): snapshot "
            f"{parts['snapshot']:.2f} s "
            f"({parts['snapshot'] / total:.0%}; `.to` copies {_share(save_rows, to):.0%}), "
            f"write {parts['write']:.2f} s (fsync {_share(save_rows, 'fsync'):.0%}, safetensors "
            f"serialize_file {_share(save_rows, 'serialize_file'):.0%}, CRC32 "
            f"{_share(save_rows, 'crc32'):.0%}), publish {parts['publish']:.2f} s."
        )
    notes.append(SAVE_FIX)
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    notes.append(
        "The machine is shared (1-minute load average at the end: "
        f"{load:.1f} on 2 cores); the interleaving keeps ratios fair, absolute GB/s move with "
        "the load. Cold reads may still be served by the VM host's cache."
    )
    return notes
