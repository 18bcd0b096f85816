"""Optional comparison rows: a row that cannot run here is left out with a note, never a failure.

A section's own checks (megatronish against a reference) fail the section; a row that only
compares with something this torch or GPU may lack (torch's varlen attention, fp8 grouped GEMMs)
is tried once first, and one that raises is dropped from the timings with the error's first line
in the report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from gpu_check.report import SectionResult

T = TypeVar("T")


SHOWN = 200  # characters of an error's first line in the report


def first_line(error: BaseException) -> str:
    """``Type: first line of the message`` (cut at ``SHOWN`` characters)."""
    text = str(error).splitlines()[0] if str(error) else ""
    text = text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def optional(out: SectionResult, name: str, make: Callable[[], T]) -> T | None:
    """``make()``, or None (noted in ``out``) when it raises: a row that cannot be built here."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - whatever an optional row raises leaves it out
        out.note(f"{name}: left out ({first_line(e)})")
        return None


def runnable(
    out: SectionResult, steps: dict[str, Callable[[], object]], optional_names: Iterable[str]
) -> dict[str, Callable[[], object]]:
    """``steps`` less each optional one that raises when run once (noted in ``out``); the
    others, and every required step, untouched and in their order."""
    dropped = set()
    for name in optional_names:
        if name in steps and optional(out, name, lambda f=steps[name]: (f(), True)[1]) is None:
            dropped.add(name)
    return {n: f for n, f in steps.items() if n not in dropped}
