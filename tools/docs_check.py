"""Run the commands of README.md and docs/*.md as a user would after `make train`, on a fresh
copy of the tree (`make docs-check`).

Commands come from the fenced code blocks tagged bash, sh, shell or console, or untagged, whose
first line (comments aside) is a command; blocks of program output are not commands, and a
console transcript gives its `$ ` lines. Backslash continuations are joined, trailing comments
dropped, a heredoc stays one command, and a block's `VAR=...` lines reach its later commands.
Each command gets the class of the first rule of tools/docs_check/rules.py that matches it:

  run   run verbatim with bash in the sandbox, in document order (README.md, then docs/*.md
        alphabetically): later commands use what earlier ones wrote
  dry   a training launch of minutes, of many processes, GPUs or SLURM: `python -m
        megatronish.train <its overrides> trainer.dry_run=true world_size=N` composes and
        validates its config, and the run it would continue must not be one the sandbox holds
        complete (the launch would exit 7) or with another config (exit 2)
  make  a make target that is the test suite or minutes long: `make -n TARGET` (it exists)
  skip  not checked, for the reason its rule gives (the user's own corpus files, ...)

A command must exit 0; 7 (the run is already complete) only where its comment says `exit 7`.

The sandbox holds the tracked and untracked-but-not-ignored files (a clone of the working tree,
uncommitted changes included) and a .venv whose entries link to this tree's (with an install
stamp of its own: make never reinstalls the shared environment). `make train` runs there first.
The output is one line per command (class, exit code, seconds, where, the command), the output
tail of every failure and a summary.

Exit codes: 0 every check passed, 1 a check (or `make train`) failed, 2 a bad argument.

Examples:
    python tools/docs_check.py                  # the whole check: make train first (minutes)
    python tools/docs_check.py --list           # the commands and their classes; runs nothing
    python tools/docs_check.py --after-train outputs/tiny   # reuse this tree's trained run
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from docs_check.extract import all_commands
from docs_check.identity import identity_problem, resolved_config, without_missing_tokenizer
from docs_check.rules import (
    Check,
    check_script,
    classify,
    dry_launch,
    expected_codes,
    is_sweep,
)
from docs_check.sandbox import copy_tree, run_bash, sandbox_env

from megatronish.config.cli_errors import OneLineArgumentParser

ROOT = Path(__file__).resolve().parents[1]
TIMEOUTS = {"run": 900.0, "dry": 300.0, "make": 120.0}  # seconds per command of each class
TRAIN_TIMEOUT = 3600.0
TRAIN_RUN = "outputs/tiny"  # the run directory of `make train` (the default job)
TAIL_LINES = 30


@dataclass(frozen=True)
class Outcome:
    """What checking one command gave."""

    check: Check
    code: int | None  # None: skipped
    seconds: float
    failure: str = ""  # why it failed ("" when it passed)
    output: str = ""  # the script that was run and its output


def run_check(check: Check, root: Path, env: dict[str, str], timeouts: dict) -> Outcome:
    """Check one command in the tree at ``root``."""
    if check.cls == "skip":
        return Outcome(check, None, 0.0)
    script, note = check_script(check), ""
    if check.cls == "dry":
        script, note = without_missing_tokenizer(script, root)
    start = time.monotonic()
    code, output = run_bash(script, root, env, timeouts[check.cls])
    seconds = time.monotonic() - start
    expected = expected_codes(check.command) if check.cls == "run" else (0,)
    failure = "" if code in expected else f"exit {code}, expected {' or '.join(map(str, expected))}"
    if not failure and check.cls == "dry":
        failure = dry_identity_failure(check, output, root)
        output = "" if failure else output  # the failure says it all; the config is long
    return Outcome(
        check, code, seconds, failure, "\n".join(filter(None, [f"$ {script}", note, output]))
    )


def dry_identity_failure(check: Check, output: str, root: Path) -> str:
    """Why the real launch of a dry-checked command would not train ("" when it would)."""
    launch = dry_launch(check.command)
    if launch is None or launch.template or is_sweep(launch):
        return ""  # a template or a sweep: no one run directory to compare
    config = resolved_config(output)
    if config is None:
        return "the dry run printed no resolved config"
    return identity_problem(config, root, expected_codes(check.command))


def report_line(outcome: Outcome) -> str:
    """``class  code  seconds  doc:line  command`` (its first line); a skip's reason."""
    c = outcome.check.command
    first = c.text.splitlines()[0] + (" ... (heredoc)" if "\n" in c.text else "")
    skipped = outcome.code is None
    code, secs = ("-", "-") if skipped else (str(outcome.code), f"{outcome.seconds:.1f}")
    mark = "FAIL " if outcome.failure else ""
    why = f"   [{outcome.check.reason}]" if skipped else ""
    return f"{mark}{outcome.check.cls:<4} {code:>4} {secs:>6}  {c.doc}:{c.line}  {first}{why}"


def failure_report(outcome: Outcome) -> str:
    """The failure, the script that was run and the tail of its output."""
    c = outcome.check.command
    tail = "\n".join(outcome.output.rstrip().splitlines()[-TAIL_LINES:])
    return f"FAILED {c.doc}:{c.line} ({outcome.check.cls}): {outcome.failure}\n{tail}\n"


def summary(outcomes: Sequence[Outcome], seconds: float, train: str) -> str:
    """One line: the commands of each class, how many failed, the times."""
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.check.cls] = counts.get(o.check.cls, 0) + 1
    classes = ", ".join(f"{n} {cls}" for cls, n in counts.items())
    failed = sum(bool(o.failure) for o in outcomes)
    return (
        f"docs-check: {len(outcomes)} commands ({classes}), {failed} failed; "
        f"make train {train}; {seconds:.0f} s in all"
    )


def prepare(root: Path, env: dict[str, str], after_train: Path | None) -> tuple[str, str]:
    """``make train`` in the tree at ``root``, or a copy of the run directory of an earlier one
    to where it writes: ``(what was done, "")``, or ``(what, why)`` when make train failed."""
    if after_train is not None:
        shutil.copytree(after_train, root / TRAIN_RUN, symlinks=True)
        return f"skipped ({after_train} copied to {TRAIN_RUN})", ""
    start = time.monotonic()
    code, output = run_bash("make train", root, env, TRAIN_TIMEOUT)
    done = f"{time.monotonic() - start:.0f} s"
    if code == 0:
        return done, ""
    return done, "\n".join([*output.rstrip().splitlines()[-TAIL_LINES:], f"exit {code}"])


def check_all(checks: Sequence[Check], root: Path, env: dict[str, str], timeouts: dict):
    """Check every command in order, printing a line for each; the outcomes."""
    outcomes = []
    for check in checks:
        outcome = run_check(check, root, env, timeouts)
        print(report_line(outcome), flush=True)
        outcomes.append(outcome)
    return outcomes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--list", action="store_true", help="print each command's class and reason; run nothing"
    )
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="run in this tree, not a copy (writes outputs/, hf_model/, tok.model, ... here)",
    )
    parser.add_argument(
        "--after-train",
        type=Path,
        metavar="DIR",
        help=f"copy this run directory of an earlier make train to the sandbox's {TRAIN_RUN} "
        "instead of running make train",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=TIMEOUTS["run"],
        metavar="S",
        help=f"seconds per run command (default {TIMEOUTS['run']:.0f})",
    )
    parser.add_argument("--keep", action="store_true", help="keep the sandbox directory")
    args = parser.parse_args(argv)
    if args.after_train is not None and not (args.after_train / "checkpoints").is_dir():
        parser.error(
            f"--after-train {args.after_train}: no checkpoints/ there; give the run directory "
            "of a make train (outputs/tiny)"
        )
    if args.after_train is not None and args.in_place:
        parser.error("--after-train copies a run into a sandbox; drop --in-place")
    if not args.timeout > 0:
        parser.error(f"--timeout {args.timeout}: give a number of seconds above 0")
    return args


def list_checks(root: Path) -> None:
    """Every command's class and the reason of its rule, in running order."""
    for check in (classify(c) for c in all_commands(root)):
        c = check.command
        print(f"{check.cls:<4}  {c.doc}:{c.line}  {c.text.splitlines()[0]}  [{check.reason}]")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        list_checks(ROOT)
        return 0
    start = time.monotonic()
    root = ROOT if args.in_place else Path(tempfile.mkdtemp(prefix="megatronish-docs-check-"))
    try:
        if not args.in_place:
            copy_tree(ROOT, root)
            print(f"docs-check: sandbox {root}", flush=True)
        env = sandbox_env(root)
        after = args.after_train.resolve() if args.after_train else None
        train, train_failure = prepare(root, env, after)
        print(f"docs-check: make train {train}", flush=True)
        if train_failure:
            print(f"{train_failure}\ndocs-check: make train failed; nothing else checked")
            return 1
        checks = [classify(c) for c in all_commands(root)]
        outcomes = check_all(checks, root, env, {**TIMEOUTS, "run": args.timeout})
    finally:
        if not args.in_place and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    failures = [o for o in outcomes if o.failure]
    print()
    for outcome in failures:
        print(failure_report(outcome))
    print(summary(outcomes, time.monotonic() - start, train))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
