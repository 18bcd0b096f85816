"""Describe a megatronish checkpoint and optionally verify every shard's CRC32.

CKPT is a checkpoint.dir (its ``latest`` step) or one step_XXXXXXX directory. Prints the format
version, step, consumed samples, the layout that saved it, tensor / shard / file counts, bytes,
and a table of tensors (global name, global shape, dtype, shards, MiB). Big models show the
first and last layer and summarise the rest; --all lists every tensor.

--verify reads every shard and checks its shape and CRC32, and checks every other file the save
wrote (the RNG and gradient-compression states of each rank) against its recorded size and
CRC32s; each problem is reported with its file, and the exit code is 1. A checkpoint saved before
files were recorded has no sizes or checksums for those files: a note lists them as not verified.

Exit codes: 0 described (and verified), 1 --verify found bad files, 2 a bad argument,
3 no readable checkpoint at CKPT (missing, a ``latest`` that names no step, damaged metadata):
one line on stderr.

Example:
    python tools/checkpoint_info.py outputs/tiny/checkpoints --verify
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict

MIB = 1 << 20
KIND_ORDER = ("model", "exp_avg", "exp_avg_sq")
LAYER = re.compile(r"layers\.(\d+)\.")
EXIT_VERIFY = 1
EXIT_DATA = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    from megatronish.config.cli_errors import OneLineArgumentParser

    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint.dir or a step_XXXXXXX directory")
    p.add_argument(
        "--verify", action="store_true", help="check every shard's CRC32 (exit 1 if bad)"
    )
    p.add_argument("--all", action="store_true", help="list every tensor (default: summarise)")
    p.add_argument("--max-rows", type=int, default=60, help="rows before summarising (60)")
    args = p.parse_args(argv)
    if args.max_rows < 1:
        p.error(f"--max-rows {args.max_rows} must be >= 1 (or pass --all)")
    return args


def _itemsize(dtype: str) -> int:
    import torch

    return getattr(torch, dtype).itemsize


def _volume(offsets: list[list[int]]) -> int:
    n = 1
    for _, length in offsets:
        n *= length
    return n


def _sort_key(name: str) -> tuple:
    kind, _, rest = name.partition("/")
    rank = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
    return rank, kind, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", rest)]


def tensor_rows(meta) -> list[tuple[str, str, str, int, int]]:
    """``(name, shape, dtype, shards, bytes)`` for every tensor, in natural order."""
    rows = []
    for name in sorted(meta.tensors, key=_sort_key):
        e = meta.tensors[name]
        nbytes = sum(_volume(s.offsets) for s in e.shards) * _itemsize(e.dtype)
        rows.append((name, "x".join(map(str, e.shape)) or "scalar", e.dtype, len(e.shards), nbytes))
    return rows


def _summary(label: str, rows: list) -> tuple:
    dtypes = ",".join(sorted({r[2] for r in rows}))
    return (label, f"{len(rows)} tensors", dtypes, sum(r[3] for r in rows), sum(r[4] for r in rows))


def summarise(rows: list) -> list:
    """Model tensors of the first and last layer (middle layers and optimizer state summed)."""
    out, by_kind = [], defaultdict(list)
    for r in rows:
        by_kind[r[0].partition("/")[0]].append(r)
    for kind, kind_rows in by_kind.items():
        if kind != "model":
            out.append(_summary(f"{kind}/*", kind_rows))
            continue
        layers = sorted({int(m.group(1)) for r in kind_rows if (m := LAYER.search(r[0]))})
        middle = []
        for r in kind_rows:
            m = LAYER.search(r[0])
            if m and layers[0] < int(m.group(1)) < layers[-1]:
                if not middle:
                    out.append(None)  # the summary row goes here
                middle.append(r)
            else:
                out.append(r)
        if middle:
            label = f"model/layers.[{layers[1]}-{layers[-2]}].*"
            out[out.index(None)] = _summary(label, middle)
    return out


def format_table(rows: list) -> str:
    """Aligned text table."""
    head = ("tensor", "global shape", "dtype", "shards", "MiB")
    cells = [head] + [(r[0], r[1], r[2], str(r[3]), f"{r[4] / MIB:.3f}") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = []
    for i, c in enumerate(cells):
        left = [c[j].ljust(widths[j]) for j in range(3)]
        right = [c[j].rjust(widths[j]) for j in range(3, 5)]
        lines.append("  ".join(left + right).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def verify(step_dir: str, meta) -> list[str]:
    """Every problem found reading each shard and checking each recorded file (empty: all
    shards match their CRC32, all files their size and CRC32s)."""
    from safetensors import safe_open

    from megatronish.checkpoint.format import CheckpointError, crc32_of
    from megatronish.checkpoint.rank_files import crc_problems, load_whole, size_problem

    by_file = defaultdict(list)
    for name, e in meta.tensors.items():
        covered = sum(_volume(s.offsets) for s in e.shards)
        if covered != _volume([[0, n] for n in e.shape]):
            by_file["(metadata)"].append(f"{name}: shards cover {covered} of {e.shape} elements")
        for s in e.shards:
            by_file[s.file].append((name, e, s))
    problems = [f"metadata.json: {p}" for p in by_file.pop("(metadata)", [])]
    for file in meta.files:  # its size first: a shard of a truncated file is then unread
        path = os.path.join(step_dir, file)
        if not os.path.exists(path):
            problems.append(f"{file}: missing (the save wrote it)")
            by_file.pop(file, None)
        elif (why := size_problem(path, meta.files[file])) is not None:
            problems.append(f"{file} {why}")
            by_file.pop(file, None)
    for file, shards in sorted(by_file.items()):
        path = os.path.join(step_dir, file)
        try:
            with safe_open(path, framework="pt") as f:
                for name, e, s in shards:
                    t = f.get_tensor(s.key)
                    if (
                        list(t.shape) != [n for _, n in s.offsets]
                        or str(t.dtype) != f"torch.{e.dtype}"
                    ):
                        problems.append(
                            f"{file}: {s.key} is {t.dtype} {list(t.shape)}, not {s.offsets}"
                        )
                    elif crc32_of(t) != s.crc32:
                        problems.append(f"{file}: {s.key} ({name}) checksum mismatch")
        except Exception as ex:  # noqa: BLE001 - safetensors raises several types
            problems.append(f"{file}: cannot read ({type(ex).__name__}: {ex})")
    for file, record in sorted(meta.files.items()):
        path = os.path.join(step_dir, file)
        if not record.get("crc32") or any(p.startswith(file) for p in problems):
            continue
        try:
            problems += crc_problems(file, record, load_whole(path))
        except CheckpointError as ex:
            problems.append(f"{file}: {ex}")
    return problems


def unrecorded_files(step_dir: str, meta) -> list[str]:
    """The files of ``step_dir`` that neither a shard nor ``files`` of its metadata describe
    (those of a checkpoint saved before files were recorded: its RNG and compression states)."""
    from megatronish.checkpoint.format import METADATA

    known = {METADATA, *meta.files, *(s.file for e in meta.tensors.values() for s in e.shards)}
    return sorted(f for f in os.listdir(step_dir) if f not in known)


def describe(step_dir: str, meta, show_all: bool, max_rows: int) -> str:
    """The report printed without --verify."""
    files = sorted({s.file for e in meta.tensors.values() for s in e.shards})
    disk = sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir))
    rows = tensor_rows(meta)
    kinds = defaultdict(int)
    for r in rows:
        kinds[r[0].partition("/")[0]] += 1
    lay = meta.layout
    layout = " ".join(
        f"{k}={lay[k]}" for k in ("tp", "pp", "vpp", "dp", "sp", "zero_stage") if k in lay
    )
    model = meta.config.get("model", {})
    shards = sum(len(e.shards) for e in meta.tensors.values())
    lines = [
        f"checkpoint        {step_dir}",
        f"format version    {meta.format_version}",
        f"step              {meta.step}",
        f"consumed samples  {meta.consumed_samples}",
        f"optimizer steps   {meta.trainer.get('optimizer_steps', '?')}",
        f"saved with        {layout or '?'} (world size {lay.get('world_size', '?')})",
        f"model             {model.get('arch', '?')}, {model.get('num_layers', '?')} layers, "
        f"hidden {model.get('hidden_size', '?')}",
        f"tensors           {len(rows)} (" + ", ".join(f"{k} {n}" for k, n in kinds.items()) + ")",
        f"shards            {shards} in {len(files)} files",
        f"tensor bytes      {sum(r[4] for r in rows):,} ({sum(r[4] for r in rows) / MIB:.2f} MiB)",
        f"on disk           {disk:,} bytes (all files of the step directory)",
        "",
    ]
    shown = rows if show_all or len(rows) <= max_rows else summarise(rows)
    lines.append(format_table(shown))
    if shown is not rows:
        lines.append(f"({len(rows)} tensors summarised; --all lists every one)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the report (and verify); returns the exit code."""
    args = parse_args(argv)
    from megatronish.checkpoint.format import CheckpointError, read_metadata, resolve_step_dir

    try:
        step_dir = resolve_step_dir(args.ckpt)
        meta = read_metadata(step_dir)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DATA
    print(describe(step_dir, meta, args.all, args.max_rows))
    if not args.verify:
        return 0
    problems = verify(step_dir, meta)
    shards = sum(len(e.shards) for e in meta.tensors.values())
    if problems:
        print(
            f"\nverify: FAILED, {len(problems)} problem(s) in {shards} shards and "
            f"{len(meta.files)} files:",
            file=sys.stderr,
        )
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return EXIT_VERIFY
    files = len(meta.files)
    print(f"\nverify: OK, {shards} shards match their CRC32, {files} files their size and CRC32s")
    if unrecorded := unrecorded_files(step_dir, meta):
        print(
            f"note: not verified (the save recorded no size or checksum): {', '.join(unrecorded)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
