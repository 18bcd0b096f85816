"""Every memory figure the experiments' comments and docs/planning.md's tables state is what the
planner computes today (pure: plans only, no processes).

An experiment states planned memory in one machine-checkable form, a command line followed by
one line per layout::

    # Planned memory per GPU (peak + runtime; tests/plan/test_memory_claims.py checks it):
    #   python -m megatronish.plan +experiment=gpt_1b world_size=8 device=h100 OVERRIDES
    #   as configured (tp=2 sp, ZeRO 1, micro batch 4): ~16 GiB
    #   parallel.tp=1 parallel.sp=false: ~25 GiB

``OVERRIDES`` stands for each line's ``key=value`` words (``as configured``: none; a key the
command also gives takes the line's value). ``~N GiB`` is the planned peak plus the runtime (what
must fit the device) within 1 GiB. A GiB figure anywhere else in an experiment's comments is
refused: it could go stale unnoticed. docs/planning.md's tables follow the command in backticks
before each; their numbers are checked to their rounding.
"""

import re
from pathlib import Path

import pytest

from megatronish.config.compose import CONFIG_DIR, load_config
from megatronish.plan.cli import split_options
from megatronish.plan.devices import GiB, runtime_bytes_for
from megatronish.plan.estimate import Plan, make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.plan.rules import planning_errors

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted((Path(CONFIG_DIR) / "experiment").glob("*.yaml"))
COMMAND = re.compile(r"^#\s+python -m megatronish\.plan (?P<args>.+?) OVERRIDES\s*$")
CLAIM = re.compile(r"^#\s+(?P<what>[^:]+):\s+~(?P<gib>\d+(?:\.\d+)?) GiB\s*$")
GIB = re.compile(r"\d+(?:\.\d+)?\s*GiB")
TOLERANCE_GIB = 1.0


def merged(base: list[str], extra: list[str]) -> list[str]:
    """``base`` with the ``key=value`` words of ``extra`` replacing (or adding to) its own."""
    keys = {word.partition("=")[0] for word in extra}
    return [w for w in base if w.partition("=")[0] not in keys] + extra


def plan_of(argv: list[str]) -> Plan:
    """The plan ``python -m megatronish.plan ARGV`` prints."""
    overrides, _ = split_options(argv)
    cfg = load_config(overrides)
    world = cfg.world_size
    errors, vocab = planning_errors(cfg, world)
    assert not errors, (argv, errors)
    return make_plan(spec_of(cfg, vocab.size), layout_from_config(cfg, world))


def per_gpu_gib(plan: Plan) -> float:
    """Peak plus the runtime of a GPU, as ``memory: ... = X GiB per rank`` prints it."""
    return (plan.peak_bytes + runtime_bytes_for("cuda")) / GiB


def claims(text: str) -> tuple[list[tuple[list[str], str, float]], list[str]]:
    """``([(argv, line, GiB), ...], unchecked lines)`` of a YAML file's comments: the claims
    under each command line, and comment lines with a GiB figure that are not claims."""
    found, unchecked, base = [], [], None
    for line in text.splitlines():
        if not line.lstrip().startswith("#"):
            base = None
            continue
        if command := COMMAND.match(line):
            base = command["args"].split()
            continue
        claim = CLAIM.match(line)
        if claim and base is not None:
            what = claim["what"].strip()
            extra = [] if what.startswith("as configured") else what.split()
            found.append((merged(base, extra), line, float(claim["gib"])))
            continue
        base = None
        if GIB.search(line):
            unchecked.append(line)
    return found, unchecked


def test_the_parser_reads_claims_and_refuses_loose_figures():
    text = """# Planned memory per GPU (peak + runtime):
#   python -m megatronish.plan +experiment=gpt_1b world_size=8 device=h100 OVERRIDES
#   as configured (tp=2 sp): ~16 GiB
#   parallel.tp=1 world_size=16: ~25 GiB
# Prose with a figure, ~3 GiB, is not a claim.
#   parallel.pp=2: ~13 GiB
name: x
"""
    found, unchecked = claims(text)
    assert [(argv, gib) for argv, _, gib in found] == [
        (["+experiment=gpt_1b", "world_size=8", "device=h100"], 16.0),
        (["+experiment=gpt_1b", "device=h100", "parallel.tp=1", "world_size=16"], 25.0),
    ]
    assert unchecked == [
        "# Prose with a figure, ~3 GiB, is not a claim.",
        "#   parallel.pp=2: ~13 GiB",
    ]


def stale(found: list[tuple[list[str], str, float]]) -> list[str]:
    """The claims of :func:`claims` more than :data:`TOLERANCE_GIB` off the planner's."""
    wrong = []
    for argv, line, gib in found:
        planned = per_gpu_gib(plan_of(argv))
        if abs(planned - gib) > TOLERANCE_GIB:
            wrong.append(f"{line.strip()}  -> the planner says {planned:.1f} GiB")
    return wrong


def test_a_stale_figure_is_caught():
    """gpt_1b's default plans 16.0 GiB per GPU (docs/planning.md): 18.5 and 14.5 are stale, 16
    is not."""
    command = "#   python -m megatronish.plan +experiment=gpt_1b world_size=8 device=h100 OVERRIDES"
    for gib, caught in (("16", False), ("18.5", True), ("14.5", True)):
        found, _ = claims(f"{command}\n#   as configured: ~{gib} GiB\n")
        assert bool(stale(found)) == caught, gib


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.stem == "gpt_7b" else p for p in EXPERIMENTS],
    ids=[p.stem for p in EXPERIMENTS],
)
def test_experiment_memory_comments_match_the_planner(path):
    found, unchecked = claims(path.read_text())
    assert not unchecked, (
        f"{path.name}: GiB figures outside the checked form (see this file's docstring): "
        f"{unchecked}"
    )
    wrong = stale(found)
    assert not wrong, f"{path.name}: stale memory comments: {wrong}"


# -- docs/planning.md ------------------------------------------------------------------------------

DOC_COMMAND = re.compile(r"`python -m megatronish\.plan (?P<args>[^`]+)`")
DOC_COLUMNS = [
    "overrides",
    "states GiB",
    "+ in step",
    "activations GiB",
    "peak + runtime GiB",
    "fits 80 GB",
    "bubble",
]


def doc_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """``[(command argv, rows), ...]``: each table whose columns are :data:`DOC_COLUMNS`, with
    the last planner command in backticks before it."""
    tables, base, rows = [], None, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells == DOC_COLUMNS:
            assert base is not None, f"no planner command before the table at {line!r}"
            rows = []
            tables.append((base, rows))
        elif line.startswith("|") and rows is not None:
            if not set(cells[0]) <= {"-"}:
                rows.append(cells)
        else:
            rows = None
            if command := DOC_COMMAND.search(line):
                base = command["args"].split()
    return tables


def row_numbers(plan: Plan, device_gib: float) -> list[str]:
    """A table row's cells after the overrides, for the stage with the largest peak."""
    st = max(plan.stages, key=lambda s: s.peak)
    need = st.peak + runtime_bytes_for("cuda")
    in_step = st.states.params_step + st.states.grads_step
    return [
        f"{st.states.total / GiB:.1f}",
        f"{in_step / GiB:.1f}",
        f"{st.activations.peak / GiB:.1f}",
        f"{need / GiB:.1f}",
        "yes" if need <= device_gib * GiB else "no",
        f"{plan.bubble:.1%}",
    ]


@pytest.mark.slow
def test_planning_doc_tables_are_the_planners():
    text = (ROOT / "docs" / "planning.md").read_text()
    tables = doc_tables(text)
    assert len(tables) >= 3, "docs/planning.md's memory tables (or their commands) are missing"
    wrong = []
    for base, rows in tables:
        options = split_options(base)[1]
        for cells in rows:
            extra = [] if cells[0] == "`(experiment default)`" else cells[0].strip("`").split()
            got = row_numbers(plan_of(merged(base, extra)), options["device_memory_gb"])
            if got != cells[1:]:
                wrong.append(f"{' '.join(base)} {' '.join(extra)}: doc {cells[1:]}, plan {got}")
    assert not wrong, "docs/planning.md differs from the planner:\n" + "\n".join(wrong)
