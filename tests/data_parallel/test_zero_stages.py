"""The ZeRO stage table: what each stage shards, as docs/parallelism.md describes it."""

import re
from dataclasses import astuple
from pathlib import Path

import pytest

from megatronish.data_parallel.stages import ZERO_STAGES, ZeroStage

DOCS = Path(__file__).resolve().parents[2] / "docs" / "parallelism.md"

# stage: (optimizer state, grads, params) sharded; then reduce-scatters, reduces per microbatch,
# gathers after the update, norm over the world
EXPECTED = {
    0: (False, False, False, False, False, False, False),
    1: (True, False, False, True, False, True, True),
    2: (True, True, False, True, True, True, True),
    3: (True, True, True, True, True, False, True),
}


def what(stage: ZeroStage) -> tuple[bool, ...]:
    return (
        stage.shards_optimizer_state,
        stage.shards_grads,
        stage.shards_params,
        stage.reduce_scatters_grads,
        stage.reduces_per_microbatch,
        stage.gathers_after_update,
        stage.norm_over_world,
    )


@pytest.mark.parametrize("number", [0, 1, 2, 3])
def test_each_stage_shards_what_zero_defines(number):
    stage = ZERO_STAGES[number]
    assert stage.number == number
    assert what(stage) == EXPECTED[number]


def test_each_stage_shards_everything_the_one_before_does_and_one_thing_more():
    for number in (1, 2, 3):
        before, stage = astuple(ZERO_STAGES[number - 1])[1:], astuple(ZERO_STAGES[number])[1:]
        assert all(s >= b for s, b in zip(stage, before))
        assert sum(stage) == sum(before) + 1


def docs_table() -> dict[int, dict[str, str]]:
    """``stage -> {column: cell}`` of the stage table in docs/parallelism.md ("as N" resolved)."""
    lines = [ln for ln in DOCS.read_text().splitlines() if ln.startswith("| ")]
    header = next(ln for ln in lines if ln.startswith("| stage |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows: dict[int, dict[str, str]] = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == len(columns) and cells[0].isdigit():
            rows[int(cells[0])] = dict(zip(columns, cells))
    for row in rows.values():
        for column, cell in row.items():
            if m := re.fullmatch(r"as (\d)", cell):
                row[column] = rows[int(m.group(1))][column]
    return rows


def test_the_table_matches_the_docs():
    table = docs_table()
    assert sorted(table) == sorted(ZERO_STAGES)
    for number, stage in ZERO_STAGES.items():
        row = table[number]
        assert ("sharded" in row["Adam moments"]) == stage.shards_optimizer_state, row
        assert ("reduce-scattered" in row["grads"]) == stage.reduce_scatters_grads, row
        assert ("every microbatch" in row["grads"]) == stage.reduces_per_microbatch, row
        assert row["params"].startswith("sharded") == stage.shards_params, row
        assert ("after the step" in row["params"]) == stage.gathers_after_update, row
