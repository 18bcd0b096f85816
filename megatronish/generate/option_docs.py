"""The ``key=value`` options of ``python -m megatronish.generate``, for its ``--help`` and
docs/config.md; the defaults are read from :class:`Options` and :class:`Sampling`."""

from __future__ import annotations

from megatronish.config.option_docs import OptionDoc
from megatronish.generate.options import DEVICES, Options
from megatronish.generate.sampling import Sampling

_DEFAULT = Options(prompt="")


def _bool(value: bool) -> str:
    return "true" if value else "false"


GENERATE_OPTION_DOCS = (
    OptionDoc(
        "checkpoint",
        "path",
        "the run's checkpoint.dir",
        "a checkpoint.dir (its latest step) or one step_XXXXXXX directory; without it the "
        "other arguments are the run's training overrides (as given to megatronish.train)",
        "PATH",
    ),
    OptionDoc(
        "prompt",
        "str",
        "",
        "required: the text to continue; prompt='' starts a new document",
        "TEXT",
    ),
    OptionDoc(
        "max_new_tokens",
        "int",
        f"{_DEFAULT.max_new_tokens}",
        "tokens to add at most; generation stops earlier at the end-of-document token. "
        "Prompt and new tokens must fit the model's context (model.seq_length)",
    ),
    OptionDoc(
        "greedy",
        "bool",
        "true unless temperature, top_k or top_p is given",
        "the most likely token each step, or (false) a draw from the softmax",
        "true|false",
    ),
    OptionDoc(
        "temperature",
        "float",
        f"{Sampling.temperature}",
        "divides the logits before the draw (lower: closer to greedy); implies greedy=false",
    ),
    OptionDoc(
        "top_k",
        "int",
        f"{Sampling.top_k}",
        "draw from the k most likely tokens only (0: all); implies greedy=false",
    ),
    OptionDoc(
        "top_p",
        "float",
        f"{Sampling.top_p}",
        "draw from the fewest most likely tokens whose probability reaches p (1: all); "
        "implies greedy=false",
    ),
    OptionDoc("seed", "int", f"{_DEFAULT.seed}", "seeds the draw"),
    OptionDoc(
        "device",
        "str",
        _DEFAULT.device,
        f"{' | '.join(DEVICES)}: auto takes the GPU when there is one",
    ),
    OptionDoc(
        "tokenizer_model",
        "path",
        "the run's (data.tokenizer_model, an imported model's HF "
        "directory, or the built-in corpus's cached one)",
        "a sentencepiece .model, a tokenizer.json or a directory holding one, instead of the run's",
        "PATH",
    ),
    OptionDoc("verify", "bool", _bool(_DEFAULT.verify), "check each shard's CRC32 while reading"),
)
