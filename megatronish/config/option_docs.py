"""The ``key=value`` options an entry point takes besides the training config (the planner's,
generate's), one record each: the entry point's ``--help`` and docs/config.md are written from
the same records (``tools/config_reference.py``)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

WIDTH = 100
KEY_COLUMN = 26  # where the meaning starts in --help


@dataclass(frozen=True)
class OptionDoc:
    """One ``key=value`` option: ``value`` is how --help writes its value (``N``, ``PATH``),
    ``default`` what applies without it (a value or a phrase; empty: nothing)."""

    key: str
    type: str
    default: str
    meaning: str
    value: str = ""

    def usage(self) -> str:
        return f"{self.key}={self.value or self.default or self.type.upper()}"


def options_help(title: str, options: Sequence[OptionDoc]) -> str:
    """``title`` and one wrapped entry per option, as --help prints them."""
    lines = [title]
    for o in options:
        shown = o.value and o.default  # a default that the usage does not show
        meaning = o.meaning + (f"; default: {o.default}" if shown else "")
        head = f"  {o.usage()}"
        if len(head) >= KEY_COLUMN - 1:  # a long key: its meaning starts on the next line
            lines.append(head)
            head = ""
        indent = " " * KEY_COLUMN
        lines.append(
            textwrap.fill(
                meaning, WIDTH, initial_indent=head.ljust(KEY_COLUMN), subsequent_indent=indent
            )
        )
    return "\n".join(lines)


def _example(command: str) -> str:
    """``command`` indented, its long lines continued with a backslash."""
    lines = textwrap.wrap(command, WIDTH - 8, break_long_words=False, break_on_hyphens=False)
    return "  " + " \\\n      ".join(lines)


def help_text(doc: str, sections: Sequence[str], examples: Sequence[str]) -> str:
    """An entry point's --help: ``usage:`` and the first line of its module ``doc``, the rest of
    ``doc`` (reST quotes dropped), the option ``sections`` and the ``examples``."""
    usage, _, body = doc.strip().partition("\n")
    parts = [f"usage: {usage.strip().rstrip('.').strip('`')}", body.strip(), *sections]
    parts.append("Examples:\n" + "\n".join(_example(e) for e in examples))
    return "\n\n".join(parts).replace("``", "") + "\n"
