"""tools/mutants.py finds its planted bugs' anchors however the formatter lays the code out."""

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_mutants():
    spec = importlib.util.spec_from_file_location("mutants", REPO / "tools" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutants"] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


mutants = _load_mutants()

WRAPPED = """def f(group, tensor):
    if group.size > 1:
        return all_reduce(
            tensor.clone(),
            group,
            op="sum",
        )
    return tensor
"""


def test_a_verbatim_anchor_is_replaced_as_written():
    text = "x = 1\n    return all_reduce(x, group)\n"
    spans = mutants.anchor_spans(text, "    return all_reduce(x, group)")
    assert len(spans) == 1
    out = mutants.replace_anchor(text, spans[0], "    return all_reduce(x, group)", "    return x")
    assert out == "x = 1\n    return x\n"


def test_an_anchor_written_on_one_line_finds_the_formatter_s_wrapped_call():
    old = '        return all_reduce(tensor.clone(), group, op="sum")\n'
    spans = mutants.anchor_spans(WRAPPED, old)
    assert len(spans) == 1
    out = mutants.replace_anchor(WRAPPED, spans[0], old, "        return tensor.clone()\n")
    ast.parse(out)  # still Python, indentation included
    assert "return tensor.clone()\n    return tensor" in out and "all_reduce" not in out


def test_an_anchor_that_matches_twice_is_reported_not_applied(tmp_path):
    (tmp_path / "m.py").write_text("a = f(x, y)\nb = f(x,\n      y)\n")
    twice = mutants.Mutant("twice", "", "m.py", (("f(x,y)", "g(x)"),), ("t",))
    assert mutants.edit_problems(twice, tmp_path) == ["twice: 'f(x,y)' occurs 2 times in m.py"]


@pytest.mark.parametrize("line_length", [80, 120])
def test_every_mutant_applies_to_the_package_formatted_at_another_width(tmp_path, line_length):
    """Re-wrapping by ``ruff format`` (lines joined at 120, split at 80) turns no mutant stale."""
    files = {m.file for m in mutants.MUTANTS}
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, tmp_path / f)
    ruff = [sys.executable, "-m", "ruff", "format", "-q", "--line-length", str(line_length)]
    subprocess.run([*ruff, *sorted(files)], cwd=tmp_path, check=True)
    changed = [f for f in files if (tmp_path / f).read_text() != (REPO / f).read_text()]
    assert changed, "the formatter changed nothing: the test would prove nothing"
    problems = [p for m in mutants.MUTANTS for p in mutants.edit_problems(m, tmp_path)]
    assert not problems, "\n".join(problems)
    for m in mutants.MUTANTS:  # each mutated file still parses
        text = (tmp_path / m.file).read_text()
        for old, new in m.edits:
            spans = mutants.anchor_spans(text, old)
            text = mutants.replace_anchor(text, spans[0], old, new)
        ast.parse(text, m.file)


KINDS = """
import pytest


def test_assert():
    assert 1 == 2


def test_not_raised():
    with pytest.raises(ValueError):
        pass


def test_name_error():
    return undefined_name


def test_index_error():
    return [][1]


def _check(rank, world):
    assert rank == 0, "rank 1 disagrees"


def _crash(rank, world):
    return undefined_name


def test_world_check():
    from megatronish.testing.multiproc import run_world

    run_world(_check, 2, timeout=30, collective_timeout=5)


def test_world_crash():
    from megatronish.testing.multiproc import run_world

    run_world(_crash, 2, timeout=30, collective_timeout=5)


def test_world_crash_reworded():
    from megatronish.testing.multiproc import WorldError, run_world

    try:
        run_world(_crash, 2, timeout=30, collective_timeout=5)
    except WorldError as e:
        raise AssertionError("the world failed") from e


def test_passes():
    pass
"""


@pytest.fixture(scope="module")
def kinds_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    (root / "megatronish").symlink_to(REPO / "megatronish")
    (root / "tests").mkdir()
    (root / "tests" / "test_kinds.py").write_text(KINDS)
    (root / "tests" / "test_broken.py").write_text(
        "import no_such_module\n\n\ndef test_x():\n    pass\n"
    )
    return root


@pytest.mark.parametrize(
    "test, verdict, detail",
    [
        ("test_kinds.py::test_assert", "CAUGHT", ""),
        ("test_kinds.py::test_not_raised", "CAUGHT", ""),  # pytest.raises: DID NOT RAISE
        ("test_kinds.py::test_name_error", "CRASHED", "NameError"),
        ("test_kinds.py::test_index_error", "CRASHED", "IndexError"),
        ("test_kinds.py::test_world_check", "CAUGHT", ""),
        ("test_kinds.py::test_world_crash", "CRASHED", "NameError"),
        ("test_kinds.py::test_world_crash_reworded", "CRASHED", "NameError"),
        ("test_kinds.py::test_passes", "SURVIVED", ""),
        ("test_broken.py", "CRASHED", "collection error"),
    ],
)
def test_a_mutant_is_caught_only_by_a_failed_assertion(kinds_root, test, verdict, detail):
    """A named test that fails by an assertion (in the test or on a rank of its world) catches
    the mutant; one that fails by another exception, even re-raised as an assertion, crashed."""
    outcome = mutants.run_tests(kinds_root, (f"tests/{test}",), timeout=120)
    assert (outcome.verdict, outcome.detail) == (verdict, detail), outcome
    if verdict != "SURVIVED":
        assert outcome.test == f"tests/{test}"


def test_a_timeout_is_a_crash(kinds_root):
    outcome = mutants.run_tests(kinds_root, ("tests/test_kinds.py::test_passes",), timeout=0.01)
    assert outcome.verdict == "CRASHED" and outcome.detail.startswith("timed out"), outcome


def test_the_summary_names_every_mutant_not_caught_by_an_assertion():
    ms = [mutants.Mutant(n, "", "f.py", (("a", "b"),), ("t",)) for n in "abcd"]
    outcomes = [
        mutants.Outcome("CAUGHT", "t"),
        mutants.Outcome("CRASHED", "t", "NameError"),
        mutants.Outcome("SURVIVED"),
        mutants.Outcome("STALE", detail="gone"),
    ]
    assert mutants.summary(ms, outcomes).splitlines() == [
        "1 of 4 caught by an assertion",
        "1 CRASHED: b (NameError)",
        "1 SURVIVED: c",
        "1 STALE: d",
    ]
