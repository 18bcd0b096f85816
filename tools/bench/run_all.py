"""Run every benchmark in its own process (a failure does not stop the others; one that fails
or is not run keeps its stored result), then render docs/benchmarks.md (``make bench``).

Each benchmark (tools/bench/NAME.py) writes docs/bench/NAME.json; exit 1 names the failed ones.

Examples:
    make bench                                              # all of them
    python tools/bench/run_all.py --quick --only tp pp      # a smoke run of two
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from common import ROOT, machine_info
from render import ORDER, render


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=ORDER,
        metavar="NAME",
        help=f"run only these ({', '.join(ORDER)})",
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    ran, failed = {}, []
    for name in args.only or ORDER:
        cmd = [sys.executable, f"tools/bench/{name}.py", *(["--quick"] if args.quick else [])]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            print(f"== {name} FAILED (its stored result, if any, is kept)", flush=True)
            failed.append(name)
        ran[name] = time.perf_counter() - start
    total = time.perf_counter() - t0
    render({"machine": machine_info(), "ran": ran, "failed": failed, "total_seconds": total})
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
