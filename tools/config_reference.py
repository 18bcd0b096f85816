"""Write docs/config.md: every key of the training config with its type, default and meaning,
the config groups' options, and the planner's and generate's own options (``make config-docs``).

The keys, types and defaults come from the dataclasses of megatronish/config/schema.py, each
meaning from the comment after the field (or the comment lines right above it); a key without
one is refused, so every new key gets a line. The default job's value (``python -m
megatronish.train`` without arguments: configs/train.yaml and its groups) is shown where it
differs from the schema's. The planner's and generate's options come from their option records
(megatronish/plan/option_docs.py, megatronish/generate/option_docs.py).

--check writes nothing and exits 1 when the page differs from what would be written (CI and
tests/tools/test_config_reference.py run it that way).

Exit codes: 0 written (or current), 1 stale page (--check) or a key without a comment,
2 a bad argument. Each error is one line on stderr.

Examples:
    python tools/config_reference.py               # writes docs/config.md
    python tools/config_reference.py --check       # exit 1 if docs/config.md is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import sys
import tokenize
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "megatronish" / "config" / "schema.py"
PAGE = ROOT / "docs" / "config.md"
EXIT_STALE = 1

HEADER = """\
# Config reference

<!-- Written by `python tools/config_reference.py` (`make config-docs`) from
megatronish/config/schema.py, configs/ and the planner's and generate's option records: edit
those and regenerate; tests/tools/test_config_reference.py fails while this page is stale. -->

Every key of the training config, as `python -m megatronish.train`, `python -m megatronish.plan`
and `python -m megatronish.generate` take it on the command line (`key=value`). The default is
the schema's; where the default job (`python -m megatronish.train` without arguments) has
another value, that follows. An experiment (`+experiment=NAME`) and a group option
(`model=gpt_1b`) set many keys at once: `python -m megatronish.train [overrides] --cfg job`
prints the result. A mistyped key is refused with the closest valid ones. Megatron-LM's flags
and the keys they become: [megatron-flags.md](megatron-flags.md).
"""


class MissingComments(ValueError):
    """Schema fields without a comment saying what they mean."""


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """``(class name, field name) -> comment`` of every dataclass field in ``source``: the
    comment after the field, else the comment lines right above it (joined)."""
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    found = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            after = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            above, n = [], node.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            if text := " ".join(after or above):
                found[(cls.name, node.target.id)] = text
    return found


class Key(NamedTuple):
    """One key of the training config."""

    key: str
    type: str
    default: object
    meaning: str


class Section(NamedTuple):
    """A dataclass of the schema and its own (non-section) keys."""

    key: str  # "" for the top level
    keys: tuple[Key, ...]


def schema_sections(schema: type, comments: dict, prefix: str = "") -> list[Section]:
    """The sections of ``schema`` (itself first, then nested ones in field order); raises
    :class:`MissingComments` naming every key without a meaning."""
    own, nested, missing = [], [], []
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        has_factory = f.default_factory is not dataclasses.MISSING
        default = f.default_factory() if has_factory else f.default
        if dataclasses.is_dataclass(default):
            try:
                nested += schema_sections(type(default), comments, f"{key}.")
            except MissingComments as e:
                missing += e.args[0]
            continue
        if (meaning := comments.get((schema.__name__, f.name))) is None:
            missing.append(key)
        else:
            own.append(Key(key, str(f.type), default, meaning))
    if missing:
        raise MissingComments(missing)
    return [Section(prefix.rstrip("."), tuple(own)), *nested]


def type_text(annotation: str) -> str:
    """``int | None`` -> ``int or null``; ``list[Any]`` -> ``list``."""
    parts = [p.strip().replace("[Any]", "") for p in annotation.split("|")]
    return " or ".join("null" if p == "None" else p for p in parts)


def value_text(value: object) -> str:
    """A value as it is written on the command line or in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if value == "":
        return "''"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def default_job() -> dict:
    """The default job's config, unresolved (``${out_dir}`` stays as written)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megatronish.config.compose import CONFIG_DIR
    from megatronish.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="train")
    return OmegaConf.to_container(cfg, resolve=False)


def _lookup(tree: dict, key: str) -> object:
    for part in key.split("."):
        tree = tree[part]
    return tree


def key_table(section: Section, job: dict) -> list[str]:
    """The markdown table of a section's keys."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for k in section.keys:
        default = f"`{value_text(k.default)}`"
        if (ours := _lookup(job, k.key)) != k.default:
            default += f" (default job: `{value_text(ours)}`)"
        rows.append(
            f"| `{k.key}` | {_cell(type_text(k.type))} | {_cell(default)} | {_cell(k.meaning)} |"
        )
    return rows


def group_table() -> list[str]:
    """Each config group's options with the first comment line of its file."""
    from megatronish.config.compose import CONFIG_DIR

    rows = ["| group | option | what it is |", "|---|---|---|"]
    for group in sorted(p for p in Path(CONFIG_DIR).iterdir() if p.is_dir()):
        if group.name == "hydra":  # Hydra's own settings (the --help template)
            continue
        for option in sorted(group.glob("*.yaml")):
            comment = next(
                (
                    ln.lstrip("#").strip()
                    for ln in option.read_text().splitlines()
                    if ln.startswith("#") and "@package" not in ln
                ),
                "",
            )
            plus = "+" if group.name == "experiment" else ""
            rows.append(f"| {group.name} | `{plus}{group.name}={option.stem}` | {_cell(comment)} |")
    return rows


def option_table(options) -> list[str]:
    """The markdown table of an entry point's own options."""
    rows = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for o in options:
        # with a placeholder (N, PATH) the default is a phrase or nothing, else a value
        default = (o.default or "none") if o.value else f"`{o.default}`"
        rows.append(f"| `{o.key}` | {o.type} | {_cell(default)} | {_cell(o.meaning)} |")
    return rows


def render() -> str:
    """The whole page; raises :class:`MissingComments`."""
    from megatronish.config.schema import TrainConfig
    from megatronish.generate.option_docs import GENERATE_OPTION_DOCS
    from megatronish.plan.option_docs import ADVISOR_OPTION_DOCS, PLAN_OPTION_DOCS

    sections = schema_sections(TrainConfig, field_comments(SCHEMA.read_text()))
    job = default_job()
    out = [
        HEADER,
        "## Config groups",
        "",
        "`configs/<group>/<option>.yaml`; `configs/train.yaml` picks the default job's.",
        "",
        *group_table(),
    ]
    for section in sections:
        out += ["", f"## {section.key or 'Top level'}", "", *key_table(section, job)]
    out += [
        "",
        "## Planner options",
        "",
        "`python -m megatronish.plan` takes these besides the training config "
        "([planning.md](planning.md)).",
        "",
        *option_table(PLAN_OPTION_DOCS),
        "",
        "### Advisor options",
        "",
        'With `advise=true` ([performance.md](performance.md), "Choosing a layout").',
        "",
        *option_table(ADVISOR_OPTION_DOCS),
        "",
        "## Generation options",
        "",
        "`python -m megatronish.generate` takes these; without `checkpoint=PATH` its other "
        "arguments are the run's training overrides.",
        "",
        *option_table(GENERATE_OPTION_DOCS),
    ]
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    from megatronish.config.cli_errors import OneLineArgumentParser

    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=PAGE, help=f"the page ({PAGE.relative_to(ROOT)})")
    p.add_argument("--check", action="store_true", help="exit 1 if the page is stale; no write")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Write or check the page; returns the exit code."""
    args = parse_args(argv)
    try:
        page = render()
    except MissingComments as e:
        print(
            f"{SCHEMA.relative_to(ROOT)}: no comment says what {', '.join(e.args[0])} "
            "mean(s); add `# meaning` after each field",
            file=sys.stderr,
        )
        return EXIT_STALE
    current = args.out.read_text() if args.out.is_file() else None
    if args.check:
        if current != page:
            print(
                f"{args.out} is stale: run `make config-docs` (python tools/config_reference.py)",
                file=sys.stderr,
            )
            return EXIT_STALE
        return 0
    if current != page:
        args.out.write_text(page)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
