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
