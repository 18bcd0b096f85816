"""docs/config.md is what tools/config_reference.py writes from the config schema (so a new key
needs a comment saying what it means, and a regenerated page: ``make config-docs``), the
planner's and generate's option records cover every option they parse, and
docs/megatron-flags.md names only keys that exist."""

import dataclasses
import re
from pathlib import Path

import pytest

from megatronish.config.did_you_mean import schema_keys
from megatronish.testing.cli import load_tool, run_main

REPO = Path(__file__).resolve().parents[2]
reference = load_tool("config_reference")


def test_config_page_is_current():
    page = reference.render()
    assert (REPO / "docs" / "config.md").read_text() == page, (
        "docs/config.md is stale: run `make config-docs`"
    )


def test_the_page_has_a_row_for_every_key():
    page = (REPO / "docs" / "config.md").read_text()
    sections = {k.rpartition(".")[0] for k in schema_keys()} - {""}
    missing = [k for k in schema_keys() if k not in sections and f"| `{k}` |" not in page]
    assert not missing


def test_comments_after_and_above_a_field_are_its_meaning():
    source = (
        "class A:\n"
        "    x: int = 1  # the x\n"
        "    # the y,\n"
        "    # on two lines\n"
        "    y: list[int] = field(\n"
        "        default_factory=list)\n"
        "    z: int = 3\n"
    )
    assert reference.field_comments(source) == {
        ("A", "x"): "the x",
        ("A", "y"): "the y, on two lines",
    }


def test_a_key_without_a_comment_is_refused():
    @dataclasses.dataclass
    class Inner:
        a: int = 1
        b: int = 2

    @dataclasses.dataclass
    class Outer:
        c: int = 3
        inner: Inner = dataclasses.field(default_factory=Inner)

    comments = {("Outer", "c"): "the c", ("Inner", "a"): "the a"}
    with pytest.raises(reference.MissingComments) as e:
        reference.schema_sections(Outer, comments)
    assert e.value.args[0] == ["inner.b"]
    comments[("Inner", "b")] = "the b"
    sections = reference.schema_sections(Outer, comments)
    assert [(s.key, [k.key for k in s.keys]) for s in sections] == [
        ("", ["c"]),
        ("inner", ["inner.a", "inner.b"]),
    ]


def test_check_exits_1_while_the_page_is_stale(tmp_path, capfd):
    page = tmp_path / "config.md"
    page.write_text("# Config reference\n")
    code, _, err = run_main(reference.main, ["--check", "--out", page], capfd)
    assert code == 1 and "is stale: run `make config-docs`" in err
    assert run_main(reference.main, ["--out", page], capfd)[0] == 0
    code, _, err = run_main(reference.main, ["--check", "--out", page], capfd)
    assert code == 0 and err == ""


def test_every_planner_and_generate_option_is_documented():
    from megatronish.generate.option_docs import GENERATE_OPTION_DOCS
    from megatronish.generate.options import OPTIONS
    from megatronish.plan.cli import PLAN_OPTIONS
    from megatronish.plan.option_docs import ADVISOR_OPTION_DOCS, PLAN_OPTION_DOCS

    planner = {o.key for o in (*PLAN_OPTION_DOCS, *ADVISOR_OPTION_DOCS)}
    assert planner == {*PLAN_OPTIONS, "world_size"}  # world_size: a key of the training config
    assert {o.key for o in GENERATE_OPTION_DOCS} == set(OPTIONS)


def megatron_rows() -> list[tuple[str, str]]:
    """``(Megatron-LM column, megatronish column)`` of every row of docs/megatron-flags.md."""
    rows = []
    for line in (REPO / "docs" / "megatron-flags.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] not in ("Megatron-LM", "---"):
            rows.append((cells[0], cells[1]))
    return rows


def test_megatron_flag_table_names_only_keys_that_exist():
    keys = set(schema_keys())
    rows = megatron_rows()
    assert len(rows) > 80
    wrong = []
    for flag, ours in rows:
        named = re.findall(r"`([^`]+)`", ours)
        if not named and ours not in ("none", "always", "automatic"):
            wrong.append(f"{flag}: {ours!r} is neither a `key` nor none/always/automatic")
        wrong += [f"{flag}: {k} is not a key" for k in named if k.partition("=")[0] not in keys]
    assert not wrong, "\n".join(wrong)
