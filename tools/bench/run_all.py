"""Run every benchmark and regenerate ``docs/benchmarks.json`` and ``docs/benchmarks.md``.

Each benchmark is a script in this folder that runs alone and stores its section in
``docs/bench/<name>.json`` (see ``sections.py``). This runner starts each one in its own
process (so thread settings, forked worlds and memory do not leak between them), then assembles
every stored section, including those of benchmarks not run this time (``--only``), into the
JSON and the markdown page. To add a benchmark, add its script to ``BENCHMARKS``.

Usage: ``.venv/bin/python tools/bench/run_all.py [--quick] [--only NAME ...]`` (``make bench``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from common import DOCS, ROOT, machine_info
from report import render
from sections import read_section

HERE = Path(__file__).resolve().parent

# name -> script; the order of the page.
BENCHMARKS = {
    "single": "bench_single.py",
    "tp": "bench_tp.py",
    "pp": "bench_pp.py",
    "zero": "bench_zero.py",
    "checkpoint": "bench_checkpoint.py",
    "memory": "bench_memory.py",
    "advisor": "bench_advisor.py",
}


def run_one(name: str, quick: bool) -> tuple[float, bool]:
    """Run benchmark ``name`` in a fresh interpreter; returns (wall seconds, succeeded)."""
    cmd = [sys.executable, str(HERE / BENCHMARKS[name]), *(["--quick"] if quick else [])]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    ok = subprocess.run(cmd, cwd=ROOT).returncode == 0
    if not ok:
        print(f"== {name} FAILED (its stored section, if any, is kept)", flush=True)
    return time.perf_counter() - t0, ok


def assemble(ran: dict[str, float], failed: list[str], total: float) -> dict:
    """The contents of docs/benchmarks.json from every stored section."""
    sections = {n: s for n in BENCHMARKS if (s := read_section(n)) is not None}
    return {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "ran_now": ran,
        "failed": failed,
        "total_seconds": total,
        "sections": sections,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument(
        "--only", nargs="+", choices=sorted(BENCHMARKS), metavar="NAME",
        help=f"run only these ({', '.join(BENCHMARKS)}); the others keep their stored results",
    )  # fmt: skip
    args = parser.parse_args()
    t0 = time.perf_counter()
    ran, failed = {}, []
    for name in args.only or BENCHMARKS:  # one failure does not stop the others
        ran[name], ok = run_one(name, args.quick)
        if not ok:
            failed.append(name)
    total = time.perf_counter() - t0
    doc = assemble(ran, failed, total)
    (DOCS / "benchmarks.json").write_text(json.dumps(doc, indent=2) + "\n")
    page = render(list(doc["sections"].values()), doc["machine"])
    page += f"\nThis run: {', '.join(ran)} in {total:.0f} s total.\n"
    if failed:
        page += (
            f"Failed this run (sections above are from their last good run): {', '.join(failed)}.\n"
        )
    (DOCS / "benchmarks.md").write_text(page)
    print(f"wrote docs/benchmarks.json and docs/benchmarks.md ({total:.0f} s)")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
