"""The commands of markdown documents: fenced blocks of shell commands, split into commands."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

COMMAND_LANGS = ("bash", "sh", "shell", "console", "")
PROGRAMS = {
    "python",
    "python3",
    "torchrun",
    "make",
    "sbatch",
    "srun",
    "bash",
    "sh",
    "cat",
    "cd",
    "mkdir",
    "export",
    "env",
    "pip",
    "git",
    "echo",
    "ruff",
    "pytest",
}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_]\w*)\1")
NAMED_TOOL = re.compile(r"\bpython3? (tools/[\w/.-]+\.py)")
NAMED_MODULE = re.compile(r"\bpython3? -m (megatronish(?:\.\w+)*)")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language tag and lines (the fence's indentation removed)."""

    doc: str
    line: int  # the line of its first content line in ``doc`` (1-based)
    lang: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Command:
    """One documented command."""

    doc: str
    line: int
    text: str  # continuations joined, the trailing comment dropped; a heredoc keeps its lines
    comment: str = ""  # the comment line right above it and its trailing comment
    variables: tuple[str, ...] = ()  # the block's ``VAR=...`` lines before it, as written


def fenced_blocks(text: str, doc: str) -> list[Block]:
    """Every fenced code block of a markdown ``text`` (``doc`` names it)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence, lang = opened.groups()
        body, start, i = [], i + 2, i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        blocks.append(Block(doc, start, lang.lower(), tuple(body)))
        i += 1
    return blocks


def split_comment(line: str) -> tuple[str, str]:
    """``(code, comment)``: a ``#`` outside quotes, at the start or after a blank, starts the
    comment."""
    quote, escaped = "", False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def words(code: str) -> list[str]:
    """The shell words of ``code`` (split on blanks where its quotes do not close)."""
    try:
        return shlex.split(code)
    except ValueError:  # an open quote (a heredoc's body, a continued line)
        return code.split()


def is_assignment_only(code: str) -> bool:
    """Whether ``code`` only sets shell variables (``DATA="..."``)."""
    found = words(code)
    return bool(found) and all(ASSIGNMENT.match(w) for w in found)


def starts_command(line: str) -> bool:
    """Whether ``line`` begins a command: a known program, a script under scripts/ or tools/,
    or ``VAR=value`` assignments (before one, or alone)."""
    found = words(split_comment(line)[0])
    assigned = False
    while found and ASSIGNMENT.match(found[0]):
        found, assigned = found[1:], True
    if not found:
        return assigned
    return found[0] in PROGRAMS or found[0].startswith(("scripts/", "tools/", "./"))


def is_transcript(block: Block) -> bool:
    """A console transcript: its first line is a ``$ `` prompt."""
    first = next((ln for ln in block.lines if ln.strip()), "")
    return first.lstrip().startswith("$ ")


def is_command_block(block: Block) -> bool:
    """A block of commands (not of program output, a tree or a formula)."""
    if block.lang not in COMMAND_LANGS:
        return False
    if is_transcript(block):
        return True
    code = [ln for ln in block.lines if ln.strip() and not ln.lstrip().startswith("#")]
    return bool(code) and starts_command(code[0])


def logical_lines(lines: Sequence[str]) -> list[tuple[int, str]]:
    """``(index of its first line, text)`` of each shell line: continuations joined with one
    blank; a heredoc kept with its body and terminator (newlines kept)."""
    out, i = [], 0
    while i < len(lines):
        start, text = i, lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1].rstrip() + " " + lines[i].strip()
        heredoc = HEREDOC.search(split_comment(text)[0])
        if heredoc:
            while i + 1 < len(lines):
                i += 1
                text += "\n" + lines[i]
                if lines[i].strip() == heredoc.group(2):
                    break
        out.append((start, text))
        i += 1
    return out


def _shell_lines(block: Block) -> list[tuple[int, str]]:
    """The block's shell lines; of a transcript only its ``$ `` lines."""
    lines = logical_lines(block.lines)
    if not is_transcript(block):
        return lines
    return [(i, t.lstrip()[2:]) for i, t in lines if t.lstrip().startswith("$ ")]


def block_commands(block: Block) -> list[Command]:
    """The commands of a command block (none of any other), each with its comments and the
    block's variables set before it."""
    if not is_command_block(block):
        return []
    commands, variables, above = [], [], ""
    for index, text in _shell_lines(block):
        first, _, body = text.partition("\n")
        code, comment = split_comment(first)
        if not code.strip():
            above = comment  # a comment line (or "" for a blank one) for the next command
            continue
        code = code.strip() + ("\n" + body if body else "")
        if is_assignment_only(code):
            variables.append(code)
        else:
            note = " | ".join(c for c in (above, comment) if c)
            commands.append(Command(block.doc, block.line + index, code, note, tuple(variables)))
        above = ""
    return commands


def extract_commands(text: str, doc: str) -> list[Command]:
    """Every command of a markdown document, in order."""
    return [c for block in fenced_blocks(text, doc) for c in block_commands(block)]


def doc_paths(root: Path) -> list[Path]:
    """README.md, then docs/*.md alphabetically: the order their commands run in."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def all_commands(root: Path) -> list[Command]:
    """Every documented command of the tree at ``root``, in running order."""
    found = []
    for path in doc_paths(root):
        found += extract_commands(path.read_text(), str(path.relative_to(root)))
    return found


def named_entry_points(text: str) -> tuple[set[str], set[str]]:
    """``(tools/X.py paths, megatronish.X modules)`` that ``python ...`` names in ``text``."""
    return set(NAMED_TOOL.findall(text)), set(NAMED_MODULE.findall(text))


def module_exists(root: Path, module: str) -> bool:
    """Whether ``python -m module`` finds its file in the tree at ``root``."""
    path = root.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()
