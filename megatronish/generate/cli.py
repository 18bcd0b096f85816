"""``python -m megatronish.generate checkpoint=PATH prompt=TEXT [key=value ...]``.

Loads the model of any checkpoint (saved at any layout; it reshards on load) into this one
process and continues the prompt, printing the prompt and its continuation on stdout and what
was loaded and how fast it decoded on stderr. The options (``key=value``, as for train and plan)
are listed below and in docs/config.md; without ``checkpoint=PATH`` the other arguments are the
run's training overrides and the run's ``checkpoint.dir`` is used.

Greedy decoding gives, token for token, what ``transformers``' ``generate(do_sample=False)``
gives on the checkpoint's Hugging Face export (``tools/export_hf.py``).

Exit codes: 0 done, 2 invalid option (or a prompt that does not fit, or a layout other than one
process), 3 the checkpoint or tokenizer is missing or damaged.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from megatronish.config.option_docs import help_text, options_help
from megatronish.generate.option_docs import GENERATE_OPTION_DOCS
from megatronish.generate.options import OPTIONS, Options, parse_options

if TYPE_CHECKING:
    from megatronish.data.tokenizer import Tokenizer
    from megatronish.spec import ModelSpec

EXIT_OPTIONS = 2
EXIT_FILES = 3


class OptionError(ValueError):
    """An option value that turns out wrong once the model or tokenizer is known."""


def _device(requested: str):
    import torch

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise OptionError("device=cuda but no CUDA device is visible; use device=cpu or auto")
    return torch.device(requested)


def _checkpoint_path(options: Options) -> str:
    """``checkpoint=`` or the ``checkpoint.dir`` of the run its overrides compose."""
    if options.checkpoint is not None:
        return options.checkpoint
    from megatronish.config.cli_errors import composition_error_reason
    from megatronish.config.compose import load_config

    try:
        cfg = load_config(list(options.overrides))
    except Exception as e:  # noqa: BLE001 - Hydra/OmegaConf raise many types; one line out
        raise OptionError(
            f"{composition_error_reason(e, OPTIONS)} (without checkpoint=PATH, arguments other "
            f"than {', '.join(OPTIONS)} are the run's training overrides)"
        ) from e
    if not cfg.checkpoint.dir:
        raise OptionError(
            "the run saves no checkpoints (checkpoint.dir is null); pass checkpoint=PATH"
        )
    return cfg.checkpoint.dir


def _prompt_ids(text: str, tokenizer: Tokenizer, spec: ModelSpec, max_new_tokens: int) -> list[int]:
    """The prompt's token ids (the end-of-document token for an empty prompt), checked to fit
    the model's context with ``max_new_tokens`` more."""
    ids = tokenizer.encode(text) or [tokenizer.eod_id]
    if len(ids) > spec.seq_length:
        raise OptionError(
            f"the prompt is {len(ids)} tokens, longer than the model's context of "
            f"{spec.seq_length} (model.seq_length); shorten it"
        )
    room = spec.seq_length - len(ids)
    if max_new_tokens > room:
        raise OptionError(
            f"the prompt ({len(ids)} tokens) and max_new_tokens={max_new_tokens} exceed the "
            f"model's context of {spec.seq_length} tokens; use max_new_tokens<={room}"
        )
    return ids


def run(options: Options) -> int:
    """Load, generate, print; returns the exit code."""
    import torch

    from megatronish.checkpoint.format import CheckpointError
    from megatronish.distributed.launch import detect_launch
    from megatronish.generate.decode import generate
    from megatronish.generate.session import load_model
    from megatronish.generate.tokenizer import run_tokenizer

    try:
        if detect_launch().world_size > 1:
            raise OptionError(
                "generation runs in one process: start it with python -m, not "
                "torchrun or srun with several tasks"
            )
        device = _device(options.device)
        path = _checkpoint_path(options)
        loaded = load_model(path, device, options.verify)
        meta = loaded.meta
        tokenizer = run_tokenizer(meta.config, meta.trainer, options.tokenizer_model)
        if tokenizer.vocab_size > loaded.spec.vocab_size:
            raise CheckpointError(
                f"{tokenizer} has more pieces than the model's vocabulary "
                f"({loaded.spec.vocab_size}): not the run's tokenizer; pass tokenizer_model=PATH"
            )
        ids = _prompt_ids(options.prompt, tokenizer, loaded.spec, options.max_new_tokens)
    except OptionError as e:
        print(f"invalid option: {e}", file=sys.stderr)
        return EXIT_OPTIONS
    except (CheckpointError, FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FILES
    print(
        f"[generate] {loaded.describe()}; {options.sampling.describe()} on {device}",
        file=sys.stderr,
        flush=True,
    )
    generator = torch.Generator(device=device).manual_seed(options.seed)
    out = generate(
        loaded.model,
        torch.tensor([ids], device=device),
        options.max_new_tokens,
        options.sampling,
        tokenizer.eod_id,
        generator,
        tokenizer.vocab_size,
    )
    print(tokenizer.decode(out.ids[0].tolist()), flush=True)
    why = (
        "the end-of-document token"
        if out.stopped_at_eos
        else f"max_new_tokens={options.max_new_tokens}"
    )
    rate = out.new_tokens / out.seconds if out.seconds > 0 else float("inf")
    print(
        f"[generate] {out.new_tokens} tokens in {out.seconds:.2f} s ({rate:.0f} tokens/s), "
        f"stopped at {why}",
        file=sys.stderr,
    )
    return 0


EXAMPLES = (
    "python -m megatronish.generate checkpoint=outputs/tiny/checkpoints prompt='def '",
    "python -m megatronish.generate +experiment=gpt_125m prompt='Once upon a time' "
    "temperature=0.8 top_p=0.9 max_new_tokens=200",
)


def generate_help() -> str:
    """What ``--help`` prints: the module docstring, every option, examples."""
    title = "Options (key=value; others locate the run when checkpoint= is not given):"
    return help_text(__doc__, [options_help(title, GENERATE_OPTION_DOCS)], EXAMPLES)


def main(argv: list[str]) -> int:
    """Parse the options and run; returns the exit code (see the module docstring)."""
    if any(a in ("-h", "--help", "help") for a in argv):
        print(generate_help(), end="")
        return 0
    options, errors = parse_options(argv)
    if errors:
        for e in errors:
            print(f"invalid option: {e}", file=sys.stderr)
        return EXIT_OPTIONS
    return run(options)
