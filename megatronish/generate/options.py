"""The ``key=value`` options of ``python -m megatronish.generate`` (pure: no torch, no files)."""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.config.cli_errors import repeated_keys_reason
from megatronish.config.compose import parse_bool
from megatronish.config.did_you_mean import closest_names, did_you_mean
from megatronish.generate.sampling import Sampling

DEVICES = ("auto", "cpu", "cuda")
ONE_PROCESS = ("parallel.tp", "parallel.cp", "parallel.pp")


def _device(text: str) -> str:
    if text not in DEVICES:
        raise ValueError(text)
    return text


def _positive(text: str) -> int:
    if int(text) < 1:
        raise ValueError(text)
    return int(text)


def _seed(text: str) -> int:
    if not 0 <= int(text) < 2**64:  # what torch.Generator.manual_seed takes
        raise ValueError(text)
    return int(text)


def _path(text: str) -> str:
    if not text.strip():
        raise ValueError(text)
    return text


# Option -> (parser, what a good value looks like).
OPTIONS = {
    "checkpoint": (_path, "a checkpoint.dir or a step_XXXXXXX directory"),
    "prompt": (str, "text, e.g. prompt='def '"),
    "max_new_tokens": (_positive, "a whole number >= 1, e.g. max_new_tokens=40"),
    "greedy": (parse_bool, "true or false"),
    "temperature": (float, "a finite number > 0, e.g. temperature=0.8"),
    "top_k": (int, "a whole number >= 0, e.g. top_k=40 (0: off)"),
    "top_p": (float, "a number in (0, 1], e.g. top_p=0.9 (1: off)"),
    "seed": (_seed, "a whole number in [0, 2**64), e.g. seed=0"),
    "device": (_device, "auto, cpu or cuda"),
    "tokenizer_model": (_path, "a sentencepiece .model, a tokenizer.json or a directory with one"),
    "verify": (parse_bool, "true or false"),
}
SAMPLING_KEYS = ("temperature", "top_k", "top_p")


@dataclass(frozen=True)
class Options:
    """What to generate, from where, and how."""

    prompt: str
    checkpoint: str | None = None  # None: the run's checkpoint.dir, composed from ``overrides``
    max_new_tokens: int = 64
    sampling: Sampling = Sampling()
    seed: int = 0
    device: str = "auto"
    tokenizer_model: str | None = None
    verify: bool = True
    overrides: tuple[str, ...] = ()  # training-config overrides that locate the run


def _unquote(value: str) -> str:
    """A value wrapped in one pair of matching quotes (Hydra style) without them."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _sampling(values: dict, errors: list[str]) -> Sampling:
    given = {k: values[k] for k in SAMPLING_KEYS if k in values}
    greedy = values.get("greedy", not given)
    if greedy and given:
        names = ", ".join(f"{k}={v}" for k, v in given.items())
        errors.append(f"greedy=true takes the most likely token: drop {names} or set greedy=false")
        return Sampling()
    try:
        return Sampling(greedy=greedy, **given)
    except ValueError as e:
        errors.append(str(e))
        return Sampling()


def parse_options(argv: list[str]) -> tuple[Options | None, list[str]]:
    """``(options, [])`` from the command line, or ``(None, one message per problem)``.

    Arguments that are not generation options are training-config overrides: they locate the
    run's ``checkpoint.dir`` when ``checkpoint=`` is not given, and are refused otherwise.
    """
    values: dict = {}
    overrides: list[str] = []
    layout: list[str] = []  # parallel.tp/cp/pp=1: consistent with generation, else refused
    errors: list[str] = [r] if (r := repeated_keys_reason(argv)) is not None else []
    for arg in argv:
        key, eq, raw = arg.partition("=")
        if not eq:
            errors.append(f"{arg}: expected key=value, e.g. max_new_tokens=40")
        elif key in OPTIONS:
            parse, hint = OPTIONS[key]
            try:
                values[key] = parse(_unquote(raw))
            except ValueError:
                errors.append(f"{arg}: expected {hint}")
        elif key.lstrip("+~") in ONE_PROCESS:
            if _unquote(raw) != "1":
                errors.append(
                    f"{arg}: generation runs the whole model in one process (tp=cp=pp=1) and "
                    "reshards any checkpoint on load; drop it"
                )
            layout.append(arg)
        else:
            overrides.append(arg)
    if "checkpoint" in values and overrides:
        known = ", ".join(OPTIONS)
        meant = did_you_mean(closest_names(overrides[0].partition("=")[0].lstrip("+~"), OPTIONS))
        errors.append(
            f"unknown option {overrides[0]}; {meant + ' ' if meant else ''}the options are: {known}"
        )
    if "prompt" not in values:
        errors.append("prompt=TEXT is required (prompt='' starts a new document)")
    sampling = _sampling(values, errors)
    if errors:
        return None, errors
    rest = {k: v for k, v in values.items() if k not in (*SAMPLING_KEYS, "greedy")}
    return Options(**rest, sampling=sampling, overrides=(*overrides, *layout)), []
