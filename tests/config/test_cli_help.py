"""Every entry point answers ``--help``: exit 0, nothing on stderr, a ``usage:`` line first and an
example command. The entry points are found, not listed (``tools/*.py``, the benchmark runner,
``megatronish/*/__main__.py``, ``megatronish/train.py``), so a new tool without ``--help``
fails here. The ``key=value`` entry points (train, plan, generate) point at docs/config.md and
plan and generate list every option they parse.

All of them run at once as subprocesses (each imports torch: seconds, mostly waiting), once per
module.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = re.compile(r"^\s+(python|make|torchrun)\s", re.MULTILINE)
KEY_VALUE_ENTRY_POINTS = ("megatronish.train", "megatronish.plan", "megatronish.generate")


def entry_points() -> dict[str, list[str]]:
    """``name -> argv`` (without the interpreter) of every command a user runs."""
    found = {f"tools/{p.name}": [str(p)] for p in sorted((REPO / "tools").glob("*.py"))}
    found["tools/bench/run_all.py"] = [str(REPO / "tools" / "bench" / "run_all.py")]
    for main in sorted((REPO / "megatronish").glob("*/__main__.py")):
        found[f"megatronish.{main.parent.name}"] = ["-m", f"megatronish.{main.parent.name}"]
    found["megatronish.train"] = ["-m", "megatronish.train"]
    return found


ENTRY_POINTS = entry_points()


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess]:
    """Every entry point's ``--help``, run in parallel."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = "1"
    running = {
        name: subprocess.Popen(
            [sys.executable, *argv, "--help"],
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name, argv in ENTRY_POINTS.items()
    }
    done = {}
    for name, proc in running.items():
        out, err = proc.communicate(timeout=180)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def test_the_entry_points_are_found():
    assert {
        "megatronish.train",
        "megatronish.plan",
        "megatronish.generate",
        "tools/checkpoint_info.py",
        "tools/config_reference.py",
    } <= set(ENTRY_POINTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_help_prints_usage_and_an_example(helps, name):
    done = helps[name]
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    assert done.stdout.lstrip().startswith("usage:"), done.stdout[:500]
    assert EXAMPLE.search(done.stdout), f"{name} --help shows no example command"
    if name in KEY_VALUE_ENTRY_POINTS:
        assert "docs/config.md" in done.stdout


@pytest.mark.slow
def test_plan_and_generate_help_list_every_option(helps):
    from megatronish.generate.options import OPTIONS
    from megatronish.plan.cli import PLAN_OPTIONS

    for name, options in (("megatronish.plan", PLAN_OPTIONS), ("megatronish.generate", OPTIONS)):
        missing = [k for k in options if f"  {k}=" not in helps[name].stdout]
        assert not missing, f"{name} --help does not list {missing}"
