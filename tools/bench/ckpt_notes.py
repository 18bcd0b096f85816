"""The notes of the checkpoint section: what the numbers say, where time goes, proposed fixes.

The fixes are proposals for ``megatronish/checkpoint`` (this benchmark does not change it); they
follow from the structure of the code, and the profile shares quoted next to them are measured.
"""

from __future__ import annotations

import os

from ckpt_tables import TARGET

LOAD_FIX = (
    "Proposed load fix (megatronish/checkpoint): every byte is copied three times after the "
    "read, one tensor-sized copy at a time, into memory that was zero-filled first. "
    "`load_into` allocates `torch.zeros` flats per bucket (3 x bucket size); "
    "`ShardReader.read` allocates `out` with `torch.empty` and copies the safetensors slice "
    "into it (`out[dst] = f.get_slice(key)[src]`: the copy out of the mmap, where the cold page "
    "faults land); `load_into` copies that into the flat (`rect.take(local).copy_`), then the "
    "flats into `param_flat` / `exp_avg` / `exp_avg_sq`. Give `ShardReader.read` an `out=` "
    "argument and pass `rect.take(local)` of the real destination (for ZeRO 0, `param_flat`, "
    "`exp_avg[i]` and `exp_avg_sq[i]` themselves; for ZeRO 1-3 only the owned `[lo, hi)` "
    "range, skipping pieces outside it) and zero only the bucket padding, so each byte is "
    "copied once. Better still, fill a contiguous destination with `readinto` of the shard's "
    "byte range (its data offset is in the safetensors header): one kernel copy per shard, "
    "sequential reads, no user page faults and no intra-op threads; stage a non-contiguous "
    "(tp-sliced) rectangle through one reused, pre-touched buffer."
)
SAVE_FIX = (
    "Proposed save / async-stall fix: `snapshot` copies each piece with "
    "`.to('cpu', copy=True)` into newly allocated memory on every save, so the training thread "
    "pays one intra-op parallel copy per piece (3 per parameter) plus first-touch page faults. "
    "Keep persistent host buffers (one per bucket and kind, allocated and touched once; saves "
    "are already serialised by `wait()`), copy the three flats into them with one `copy_` each "
    "and hand views of them to the writer. CRC32 and fsync already run on the writer thread. "
    "Until then, a stopgap for both save and load is to run the checkpoint copies under "
    "`torch.set_num_threads(1)` (restoring the count after)."
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
        "at 1). `load_into` makes several copies per tensor into fresh memory (slice, "
        f"rectangle, flat) and pays both: {g['load 1 thread warm']:.3f} GB/s warm and "
        f"{g['load 1 thread cold']:.3f} cold at 1 thread vs {g['load warm']:.3f} and "
        f"{g['load cold']:.3f} at 2."
    )


def findings(s: dict, prof: dict | None, load: float | None = None) -> list[str]:
    """Sentences under the tables (``load``: the 1-minute load average, default now)."""
    g, r, a = s["gbps"], s["ratio"], s["async"]
    copies, to = "method 'copy_'", "method 'to'"
    notes = [
        f"Save: {g['save']:.3f} GB/s = {r['save']:.0%} of the raw sequential write "
        f"({g['raw write']:.3f} GB/s), {_verdict(r['save'])}.",
        f"Load (`load_into`): cold {g['load cold']:.3f} GB/s = {r['load cold']:.0%} of the raw "
        f"read ({g['raw read cold']:.3f} GB/s), {_verdict(r['load cold'])}; warm "
        f"{g['load warm']:.3f} GB/s = {r['load warm']:.0%} of the raw read "
        f"({g['raw read warm']:.3f} GB/s), {_verdict(r['load warm'])}. Reading the same files "
        f"through safetensors with one copy reaches {r['load_file cold']:.0%} (cold) and "
        f"{r['load_file warm']:.0%} (warm) of raw"
        + (
            ", so the gap is megatronish's copying, not the disk or the file format."
            if min(r["load_file cold"], r["load_file warm"]) >= TARGET
            else ": many per-tensor copies are slow here (see the host-memory table)."
        ),
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
        notes.append(
            f"Cold load profile (one sample): {_share(load_rows, 'format.py'):.0%} of the wall in "
            f"`ShardReader.read` itself (allocating `out` and copying the mmap'd slice into it, "
            f"page faults included) plus {_share(load_rows, 'storage.py'):.0%} slicing the mapped "
            f"storage, {_share(load_rows, copies):.0%} in `copy_` called by `load_into` "
            f"(slice -> flat -> ZeRO buffers) and {_share(load_rows, 'torch.zeros'):.0%} in "
            "`torch.zeros` of the flats."
        )
        notes.append(LOAD_FIX)
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
