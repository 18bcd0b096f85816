"""What the documented commands (README.md, docs/*.md) write goes under outputs/, outside the
tree, or where .gitignore keeps it out of ``git status``: a user following the docs leaves no
untracked files in the repository (``make docs-check`` runs the commands; this reads them)."""

import shlex
import subprocess
from pathlib import Path

from docs_check.extract import all_commands

ROOT = Path(__file__).resolve().parents[2]
# option -> the suffixes of the files it names the prefix of
PREFIX_OPTIONS = {"--model-prefix": (".model", ".vocab"), "--output-prefix": (".bin", ".idx")}
DIR_KEYS = ("out_dir=", "checkpoint.dir=", "trainer.profile.dir=")
FILE_KEYS = ("advise_out=",)
# tools whose last argument is the directory they write
WRITES_LAST_ARGUMENT = ("tools/export_hf.py", "tools/import_hf.py")
# files the docs mean to add to the tree on purpose
IN_THE_TREE = {"configs/parallel/advised.yaml"}  # then used as parallel=advised


def written(text: str) -> list[str]:
    """The paths a documented command writes, as far as its words say (directories as
    ``DIR/x``: a directory pattern of .gitignore matches what is inside)."""
    try:
        words = shlex.split(text.splitlines()[0], comments=True)
    except ValueError:
        return []
    paths = []
    for i, word in enumerate(words):
        following = words[i + 1] if i + 1 < len(words) else None
        if word in PREFIX_OPTIONS and following:
            paths += [following + suffix for suffix in PREFIX_OPTIONS[word]]
        elif word == ">" and following:
            paths.append(following)
        elif word.startswith(DIR_KEYS):
            paths.append(word.split("=", 1)[1].rstrip("/") + "/x")
        elif word.startswith(FILE_KEYS):
            paths.append(word.split("=", 1)[1])
    tool = next((w for w in words if w.endswith(WRITES_LAST_ARGUMENT)), None)
    if tool is not None and words[-1] != tool and not words[-1].startswith("-"):
        paths.append(words[-1].rstrip("/") + "/x")
    return [p for p in paths if p and not p.startswith(("/", "$", "<", "~"))]


def test_the_documented_commands_write_nothing_git_would_show():
    wrote = {path: f"{c.doc}:{c.line}" for c in all_commands(ROOT) for path in written(c.text)}
    assert "tok.model" in wrote and any("hf_model" in p for p in wrote)  # the parsing finds them
    candidates = sorted(set(wrote) - IN_THE_TREE)
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=ROOT,
        input="\n".join(candidates),
        capture_output=True,
        text=True,
    ).stdout.split()
    shown = [f"{wrote[p]}: {p}" for p in candidates if p not in ignored]
    assert not shown, "write under outputs/ or add to .gitignore:\n" + "\n".join(shown)
