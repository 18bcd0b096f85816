"""Benchmark section results: one JSON file per benchmark under ``docs/bench/``.

A section is a plain dict that both the standalone script and ``run_all.py`` write:

``name``, ``title``, ``method`` (how it was measured, one or two sentences), ``tables`` (each
``{"caption", "columns", "rows"}`` of already formatted cells), ``notes`` (sentences under the
tables), ``raw`` (every number behind the tables), ``seconds`` (wall time of the benchmark) and
``machine`` (see :func:`common.machine_info`).
"""

from __future__ import annotations

import json
from pathlib import Path

from common import DOCS

SECTION_DIR = DOCS / "bench"


def section_path(name: str) -> Path:
    return SECTION_DIR / f"{name}.json"


def write_section(section: dict) -> Path:
    """Store ``section`` as ``docs/bench/<name>.json``; returns the path."""
    SECTION_DIR.mkdir(parents=True, exist_ok=True)
    path = section_path(section["name"])
    path.write_text(json.dumps(section, indent=2) + "\n")
    return path


def read_section(name: str) -> dict | None:
    """The stored result of benchmark ``name`` (None when it never ran)."""
    path = section_path(name)
    return json.loads(path.read_text()) if path.exists() else None


def table(caption: str, columns: list[str], rows: list[list[object]]) -> dict:
    """A table of a section (cells are formatted with ``str``)."""
    return {"caption": caption, "columns": columns, "rows": [[str(c) for c in r] for r in rows]}


def bench_cli(run, description: str) -> None:
    """The command line of a benchmark script: ``[--quick]``, run it, print and store it."""
    import argparse

    from report import render_section

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = parser.parse_args()
    section = run(args.quick)
    print(render_section(section))
    print(f"wrote {write_section(section)}")
