"""One-line reasons for the errors Hydra and OmegaConf raise while composing the config.

Hydra prints several lines per error (and a hint about ``HYDRA_FULL_ERROR``); the entry point
prints :func:`composition_error_reason` instead: what is wrong, with the key and value, and how
to fix it.
"""

from __future__ import annotations

from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

KEYS_HINT = "`python -m megatronish.train --cfg job` prints every key"


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def composition_error_reason(error: BaseException) -> str:
    """One line for an error raised while composing or resolving the config."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        group, _, name = error.missing_cfg_file.rpartition("/")
        options = [o for o in error.options or [] if not o.endswith("_schema")]
        if group:
            what = "experiment" if group == "experiment" else f"config group {group}"
            return f"{what} {name!r} does not exist; choose one of: {', '.join(options)}"
    if isinstance(error, OverrideParseException):
        return (
            f"cannot parse the override {error.override!r}: {_first_line(error.message)} "
            "(write key=value, e.g. parallel.tp=2)"
        )
    cause = error.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        key = getattr(cause, "full_key", None) or _first_line(cause)
        return f"unknown key {key}: check the spelling; {KEYS_HINT}"
    if isinstance(cause, ValidationError):
        return f"{cause.full_key}: {_first_line(cause)}"
    reason = _first_line(error).removeprefix("In 'train': ")
    if cause is not None:
        reason = f"{reason}: {_first_line(cause)}"
    return reason or type(error).__name__
