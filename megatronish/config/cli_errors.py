"""One-line reasons for the errors of a command line: Hydra and OmegaConf composition errors, a
key given twice, and argparse's usage errors in the tools.

Hydra prints several lines per error (and a hint about ``HYDRA_FULL_ERROR``); the entry points
print :func:`composition_error_reason` instead: what is wrong, with the key and value, and how
to fix it (Hydra's own fix, such as ``use +experiment=tiny``, is kept in the line). A mistyped
key, group option or flag gets the closest valid ones (:mod:`megatronish.config.did_you_mean`).
Importing this module is cheap: Hydra is imported only to explain one of its errors.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable

from megatronish.config.did_you_mean import closest_keys, closest_names, did_you_mean

KEYS_DOC = "docs/config.md lists every key"
KEYS_HINT = f"{KEYS_DOC}; `python -m megatronish.train --cfg job` prints them"
EXIT_USAGE = 2  # argparse's code for a bad command line, the trainer's for a bad config
# "+data=indexed" where data already has a value.
GROUP_TWICE = re.compile(
    r"Multiple values for (\S+)\. To override a value use 'override \S+: (\S+)'"
)
# "~trainer.max_step" where the key does not exist.
DELETE_MISSING = re.compile(r"Could not delete from config\. '(\S+)' does not exist")
# argparse's usage errors: an unknown flag, a value not among the choices.
UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]


def _first_line(text: str) -> str:
    lines = _lines(text)
    return lines[0] if lines else ""


def _joined(text: str) -> str:
    """Every line of Hydra's message up to its config search path, as one line."""
    lines = []
    for line in _lines(text):
        if line.startswith(("Config search path", "Available options")):
            break
        line = line.removesuffix(".")
        lines.append(line if not lines else line[:1].lower() + line[1:])
    return "; ".join(lines)


def unknown_key_reason(key: str, extra_keys: Iterable[str] = ()) -> str:
    """One line for a key the config does not have, with the closest valid keys (the schema's
    and ``extra_keys``, an entry point's own options)."""
    if meant := closest_keys(key, extra_keys):
        return f"unknown key {key}: {did_you_mean(meant)} ({KEYS_DOC})"
    return f"unknown key {key}: check the spelling; {KEYS_HINT}"


def composition_error_reason(error: BaseException, extra_keys: Iterable[str] = ()) -> str:
    """One line for an error raised while composing or resolving the config; ``extra_keys``:
    the entry point's own ``key=value`` options, offered for a mistyped key too."""
    from hydra.errors import (
        ConfigCompositionException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        group, _, name = error.missing_cfg_file.rpartition("/")
        options = [o for o in error.options or [] if not o.endswith("_schema")]
        if group:
            what = "experiment" if group == "experiment" else f"config group {group}"
            plus = "+" if group == "experiment" else ""
            meant = did_you_mean(f"{plus}{group}={o}" for o in closest_names(name, options))
            return (
                f"{what} {name!r} does not exist; {meant + ' ' if meant else ''}"
                f"choose one of: {', '.join(options)}"
            )
    if isinstance(error, OverrideParseException):
        return (
            f"cannot parse the override {error.override!r}: {_first_line(error.message)} "
            "(write key=value, e.g. parallel.tp=2)"
        )
    cause = error.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        key = getattr(cause, "full_key", None) or _first_line(cause)
        return unknown_key_reason(key, extra_keys)
    if isinstance(cause, ValidationError):
        return f"{cause.full_key}: {_first_line(cause)}"
    if isinstance(error, ConfigCompositionException) and cause is None:
        if (m := DELETE_MISSING.match(str(error))) and (meant := closest_keys(m[1], extra_keys)):
            return f"cannot delete {m[1]}: no such key; {did_you_mean('~' + k for k in meant)}"
        if m := GROUP_TWICE.match(str(error)):  # Hydra's fix is for a defaults list, not argv
            group, value = m.groups()
            return (
                f"config group {group} already has a value; to choose {value} write "
                f"{group}={value} (without +)"
            )
        return _joined(str(error)) or type(error).__name__  # keeps Hydra's fix line
    reason = _first_line(error).removeprefix("In 'train': ")
    if cause is not None:
        reason = f"{reason}: {_first_line(cause)}"
    return reason or type(error).__name__


def override_key(arg: str) -> str | None:
    """The key a ``key=value`` (or ``~key``) command-line argument sets or deletes (``+``,
    ``++`` and ``~`` dropped); None for flags (``--cfg``), their values and other words."""
    if arg.startswith("~"):
        key = arg[1:].partition("=")[0]
    elif "=" in arg and not arg.startswith("-"):
        key = arg.partition("=")[0].lstrip("+")
    else:
        return None
    return key.strip() or None


def repeated_keys_reason(args: list[str]) -> str | None:
    """The first key given more than once on the command line, with its values and the fix
    (Hydra would keep the last one without a word); None when every key is given once."""
    seen: dict[str, list[str]] = {}
    for arg in args:
        if (key := override_key(arg)) is not None:
            seen.setdefault(key, []).append(arg)
    for key, given in seen.items():
        if len(given) > 1:
            times = "twice" if len(given) == 2 else f"{len(given)} times"
            return (
                f"{key} is given {times} ({', '.join(given)}); only the last would count: "
                "give it once"
            )
    return None


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse with a usage error as one line on stderr (exit 2), like every other error, and
    the closest flag or choice to a mistyped one."""

    def error(self, message: str):
        meant = self._meant(message)
        message = f"{message}; {meant}" if meant else message
        self.exit(EXIT_USAGE, f"invalid argument: {message} (see {self.prog} --help)\n")

    def _meant(self, message: str) -> str:
        """``did you mean ...?`` for an unknown flag or a value not among the choices."""
        if "maybe you meant" in message:  # Python 3.14+ suggests a choice itself
            return ""
        if m := UNRECOGNIZED.match(message):
            flags = [a.partition("=")[0] for a in m[1].split() if a.startswith("--")]
            known = [s for s in self._option_string_actions if s.startswith("--")]
            return did_you_mean(closest_names(flags[0], known)) if flags else ""
        if m := INVALID_CHOICE.search(message):
            choices = re.findall(r"'([^']*)'", m[2])
            return did_you_mean(closest_names(m[1], choices, cutoff=0.6))
        return ""


def output_dir_error(path: str, what: str) -> str | None:
    """Why ``path`` cannot be the output directory ``what`` (e.g. ``OUT_DIR``) of a tool, which
    is created when missing; None when it can."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{what} {path} is a file, not a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot create {what} {path} ({e.strerror or e})"
    if not os.access(path, os.W_OK):
        return f"{what} {path} is not writable; choose another directory"
    return None
