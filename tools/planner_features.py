"""Which files of ``megatronish/plan/`` mention each parallelism feature, by concrete tokens.

Prints a table: feature -> the planner files that name it (the working tree, or the files of a
git revision). Docstrings and comments are left out (only code tokens count), and so are the
layout-independent files every feature passes through (the layout's fields, candidates, reports,
cli, advisor, fit check), listed in a second column. tests/plan/test_planner_features.py holds
the planner to its current table.

Examples:
    python tools/planner_features.py             # the working tree
    python tools/planner_features.py HEAD~1      # the planner as it was one commit ago
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "megatronish" / "plan"
FEATURES = {
    "tp/sp": r"\blayout\.(tp|sp|sequence_parallel)\b|\bsequence_parallel\b|\"tp/",
    "pipeline/vpp": r"\blayout\.(pp|vpp|schedule|v_shape|pipeline_schedule)\b|\bschedule_ops\b|"
    r"\banalytic_bubble\b|\bsimulate\b|\bsplits_backward\b|\"pp/",
    "recompute": r"\blayout\.recompute\w*|\brecompute_segments\b",
    "cp": r"\blayout\.cp\b|\"cp/|\bx\.cp\b",
    "zero/dp": r"\blayout\.(zero_stage|zero3_keep_gathered|bucket_size_mb|dp|zero_\w+)\b|"
    r"\blayout\.optimizer_offload\b|\bzero\b|\bZERO_STAGES\b|\"dp/|\"dp_cp",
    "grad compression": r"\blayout\.(grad_compression|powersgd_rank|powersgd_compress_vocab)\b",
    "moe/ep": r"\bspec\.moe\b|\bis_moe_layer\b|\blayout\.(ep|edp)\b|\bexpert\w*|\"ep/|\"edp",
}
MACHINERY = {
    "layout.py",
    "candidates.py",
    "report.py",
    "cli.py",
    "advisor.py",
    "fit_check.py",
    "option_docs.py",
    "hardware.py",
    "matmul_efficiency.py",
}


def code_only(source: str) -> str:
    """``source`` with its comments and docstrings blanked out."""
    lines = source.splitlines(keepends=True)
    drop, prev = [], tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        docstring = tok.type == tokenize.STRING and prev in (tokenize.INDENT, tokenize.NEWLINE)
        if tok.type == tokenize.COMMENT or docstring:
            drop.append((tok.start, tok.end))
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok.type
    for (r0, c0), (r1, c1) in reversed(drop):
        if r0 == r1:
            lines[r0 - 1] = lines[r0 - 1][:c0] + lines[r0 - 1][c1:]
        else:
            lines[r0 - 1] = lines[r0 - 1][:c0] + "\n"
            lines[r1 - 1] = lines[r1 - 1][c1:]
            for r in range(r0, r1 - 1):
                lines[r] = "\n"
    return "".join(lines)


def plan_files(rev: str | None) -> dict[str, str]:
    """``name -> source`` of the planner's Python files (working tree or ``rev``)."""
    if rev is None:
        return {p.name: p.read_text() for p in sorted(PLAN.glob("*.py"))}
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "megatronish/plan/"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout.split()
    return {
        Path(n).name: subprocess.run(
            ["git", "show", f"{rev}:{n}"], capture_output=True, text=True, check=True, cwd=REPO
        ).stdout
        for n in names
        if n.endswith(".py")
    }


def feature_files(files: dict[str, str]) -> dict[str, tuple[list[str], list[str]]]:
    """``feature -> (cost-model files, machinery files)`` whose code names the feature."""
    code = {name: code_only(src) for name, src in files.items()}
    out = {}
    for feature, pattern in FEATURES.items():
        hits = sorted(n for n, c in code.items() if re.search(pattern, c))
        out[feature] = (
            [n for n in hits if n not in MACHINERY],
            [n for n in hits if n in MACHINERY],
        )
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("rev", nargs="?", help="a git revision (default: the working tree)")
    rev = parser.parse_args(argv).rev
    files = plan_files(rev)
    print(f"| feature | planner files ({rev or 'working tree'}) | layout-independent files |")
    print("|---|---|---|")
    for feature, (model, machinery) in feature_files(files).items():
        print(f"| {feature} | {len(model)}: {', '.join(model)} | {', '.join(machinery)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
