"""How each documented command is checked: the rules that classify it, the exit codes it may
end with, and the script that checks it (``run``: the command; ``dry``: a dry run of the
training launch; ``make``: ``make -n``)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from docs_check.extract import ASSIGNMENT, Command, words

EXIT_7 = re.compile(r"\bexit(?: code)? 7\b")
# `...` or `<the printed overrides>`: where the user's own arguments go.
PLACEHOLDER = re.compile(r"(?<=\s)(\.\.\.|<[^<>\n]*>)(?=\s|$)")
LAUNCH = re.compile(r"megatronish\.train|launch_local\.sh|chain\.sh|train\.sbatch")
SBATCH_WORLD = 8  # a SLURM job's ranks for its dry run (one node of 8 GPUs)
CLASSES = ("run", "dry", "make", "skip")


@dataclass(frozen=True)
class Rule:
    """Commands whose text matches ``pattern`` (and whose comment matches ``comment``) get
    ``cls``; ``reason`` says why (for ``run``: why it is cheap enough)."""

    pattern: str
    cls: str
    reason: str
    comment: str = ""


@dataclass(frozen=True)
class Check:
    """A command, its class and the reason of the rule that chose it."""

    command: Command
    cls: str
    reason: str


@dataclass(frozen=True)
class DryLaunch:
    """The training overrides and world size of a launch command."""

    overrides: tuple[str, ...]
    world: int
    template: bool  # the command holds a placeholder for the user's own overrides


TRAIN = r"^python3? -m megatronish\.train\b"
SLOW = "trains for minutes (300 steps of the tiny model: 2-10 min on 2 busy cores)"
GPU_RUN = r"(?!.*\+experiment=(gpt_125m|gpt_1b|gpt_7b|gpt_1b_32k|moe_1b_7b)\b)"  # not on a CPU
SUITE = (
    "the test suite, or minutes long (make train is the precondition, run first): "
    "`make -n` checks that the target exists"
)
# First match wins.
RULES: tuple[Rule, ...] = (
    Rule(
        r"^make (train|test|test-fast|test-kernels|bench|mutants|gpu-check|gpu-wheels"
        r"|gpu-env-check|docs-check)\b",
        "make",
        SUITE,
    ),
    Rule(r"^make\b", "run", "seconds"),
    Rule(
        r"\bcorpus\.jsonl\b|\bweb\.jsonl\b|\bweb/\*\.jsonl\b",
        "skip",
        "needs the user's own corpus files",
    ),
    Rule(r"(^|\s|=)hf/\w", "skip", "needs the user's own Hugging Face model directory (hf/...)"),
    Rule(
        PLACEHOLDER.pattern,
        "skip",
        "a template: `...` (or `<...>`) stands for the user's own arguments",
    ),
    Rule(
        r"^python3? -m megatronish\.generate\b.*\+experiment=tiny_gpt2\b",
        "skip",
        "samples from the tiny_gpt2 run, which README's `+experiment=tiny_gpt2` trains for "
        "minutes (that command is dry-checked only)",
    ),
    Rule(
        r"(^|\s)sbatch\s.*\bscripts/slurm/train\.sbatch\b",
        "dry",
        f"needs SLURM and GPUs: dry-run at world size {SBATCH_WORLD}",
    ),
    Rule(
        r"^scripts/slurm/chain\.sh\b",
        "dry",
        f"submits SLURM jobs: one job's config dry-run at world size {SBATCH_WORLD}",
    ),
    Rule(r"(^|\s)scripts/launch_local\.sh\b", "dry", f"N processes; {SLOW}"),
    Rule(r"^torchrun\b.*\s-m megatronish\.train\b", "dry", f"N processes; {SLOW}"),
    Rule(TRAIN + r".*\s(--cfg|--help|trainer\.dry_run=true)\b", "run", "prints and exits"),
    Rule(
        TRAIN,
        "run",
        "its comment says it exits 7 (complete after make train): at once",
        comment=EXIT_7.pattern,
    ),
    Rule(
        TRAIN + GPU_RUN + r"(?!.*\s-m\s).*\strainer\.max_steps=1?\d\b",
        "run",
        "under 20 steps of a CPU model: about a minute",
    ),
    Rule(
        TRAIN + r".*\sout_dir=run\b",
        "run",
        "the data.md walkthrough: 60 steps of a 2-layer model at sequence 128, about a minute",
    ),
    Rule(TRAIN, "dry", SLOW),
    Rule(r"", "run", "seconds"),
)


def classify(command: Command, rules: Iterable[Rule] = RULES) -> Check:
    """The class of the first rule ``command`` matches."""
    for rule in rules:
        if re.search(rule.pattern, command.text) and re.search(rule.comment, command.comment):
            return Check(command, rule.cls, rule.reason)
    raise ValueError(f"no rule matches {command.text!r}")  # RULES ends with a catch-all


def expected_codes(command: Command) -> tuple[int, ...]:
    """0, and 7 (already complete) where the command's comment says it exits 7."""
    return (0, 7) if EXIT_7.search(command.comment) else (0,)


def variable_values(variables: Sequence[str]) -> dict[str, str]:
    """``NAME -> value`` of a block's assignment lines (quotes removed)."""
    values = {}
    for line in variables:
        for word in words(line):
            name, _, value = word.partition("=")
            values[name] = value
    return values


def expand_variables(text: str, variables: Sequence[str]) -> str:
    """``text`` with the block's ``$NAME`` and ``${NAME}`` replaced by their values."""
    for name, value in variable_values(variables).items():
        text = re.sub(rf"\$(?:{name}\b|\{{{name}\}})", lambda _, v=value: v, text)
    return text


def _count(word: str) -> int:
    return int(word) if word.isdigit() else 1  # a placeholder such as N: one


def _nproc(found: list[str]) -> int:
    """torchrun's ``--nproc-per-node`` (1 when not given)."""
    for i, w in enumerate(found):
        if w.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            return _count(w.split("=", 1)[1])
        if w in ("--nproc-per-node", "--nproc_per_node") and i + 1 < len(found):
            return _count(found[i + 1])
    return 1


def _launch_parts(found: list[str]) -> tuple[int, list[str]] | None:
    """``(ranks, overrides)`` of a launch's words (its environment removed)."""
    if found and found[0] in ("python", "python3", "torchrun") and "megatronish.train" in found:
        return _nproc(found), found[found.index("megatronish.train") + 1 :]
    if len(found) > 1 and found[0].endswith("scripts/launch_local.sh"):
        return _count(found[1]), found[2:]
    if len(found) > 1 and found[0].endswith("scripts/slurm/chain.sh"):
        return SBATCH_WORLD, found[2:]
    scripts = [i for i, w in enumerate(found) if w.endswith("scripts/slurm/train.sbatch")]
    if scripts:
        return SBATCH_WORLD, found[scripts[0] + 1 :]
    return None


def dry_launch(command: Command) -> DryLaunch | None:
    """The training overrides and world size of a ``megatronish.train`` launch (python,
    torchrun, launch_local.sh, sbatch or chain.sh); None for any other command. An explicit
    ``world_size=`` wins; placeholders for the user's overrides are dropped."""
    if not LAUNCH.search(command.text):
        return None
    text = expand_variables(command.text, command.variables)
    found = words(PLACEHOLDER.sub("", text))
    while found and ASSIGNMENT.match(found[0]):
        found = found[1:]
    parts = _launch_parts(found)
    if parts is None:
        return None
    world, overrides = parts
    sizes = [_count(o.split("=", 1)[1]) for o in overrides if o.startswith("world_size=")]
    return DryLaunch(
        tuple(overrides), sizes[-1] if sizes else world, bool(PLACEHOLDER.search(text))
    )


def dry_overrides(launch: DryLaunch) -> list[str]:
    """The launch's overrides plus ``trainer.dry_run=true world_size=N`` (where not given)."""
    extra = []
    if not any(o.startswith("trainer.dry_run=") for o in launch.overrides):
        extra.append("trainer.dry_run=true")
    if not any(o.startswith("world_size=") for o in launch.overrides):
        extra.append(f"world_size={launch.world}")
    return [*launch.overrides, *extra]


def is_sweep(launch: DryLaunch) -> bool:
    """A Hydra multirun (``-m``): one job per combination of its comma-separated values."""
    return "-m" in launch.overrides or "--multirun" in launch.overrides


def job_overrides(launch: DryLaunch) -> list[list[str]]:
    """The override list of each job the launch composes (Hydra flags dropped; a sweep: every
    combination of its values)."""
    jobs: list[list[str]] = [[]]
    for override in launch.overrides:
        if override.startswith("-"):
            continue
        key, _, value = override.partition("=")
        values = top_level_split(value) if is_sweep(launch) else [value]
        jobs = [[*job, f"{key}={v}"] for job in jobs for v in values]
    return jobs


def top_level_split(value: str) -> list[str]:
    """``a,b`` -> ``[a, b]``; commas inside brackets or quotes stay."""
    parts, depth, quote, current = [], 0, "", ""
    for ch in value:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += ch
    return [*parts, current]


def check_script(check: Check) -> str:
    """The bash script that checks a ``run``, ``dry`` or ``make`` command."""
    c = check.command
    if check.cls == "run":
        return "\n".join([*c.variables, c.text])
    if check.cls == "make":
        dry = re.sub(r"(^|\s)make(\s|$)", r"\1make -n\2", c.text, count=1)
        return "\n".join([*c.variables, dry])
    if check.cls == "dry":
        launch = dry_launch(c)
        if launch is None:
            raise ValueError(f"{c.doc}:{c.line}: a dry check needs a training launch: {c.text}")
        return shlex.join(["python", "-m", "megatronish.train", *dry_overrides(launch)])
    raise ValueError(f"{c.doc}:{c.line}: {check.cls} commands are not run")
