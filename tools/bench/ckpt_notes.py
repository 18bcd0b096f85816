"""Notes of the checkpoint benchmark section."""

from __future__ import annotations


def findings(s: dict, prof: dict | None) -> list[str]:
    return []
