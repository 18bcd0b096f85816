"""A Hugging Face ``tokenizer.json`` (through the ``tokenizers`` library) and its special tokens.

Ids are the tokenizer.json's, as ``tokenizers`` encodes them, with no special tokens added (no
BOS) and special-token text kept as text (see :mod:`megatronish.data.tokenizer`). The bos / eos
/ pad tokens come from the first file beside the tokenizer.json that names them:
``tokenizer_config.json`` or ``special_tokens_map.json`` (``eos_token``: a string or
``{"content": ...}``), then ``generation_config.json`` or ``config.json`` (``eos_token_id``, the
first of a list). A bos or pad token the tokenizer lacks is passed over (a model's files may
name another vocabulary's); an eos token it lacks is refused. When no file names one, the eos
token is the tokenizer's one special token of the usual end-of-text names (:data:`EOS_NAMES`).
The eos token is the end-of-document token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import tokenizers

HF_TOKENIZER_FILE = "tokenizer.json"
TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # name tokens as text
ID_FILES = ("generation_config.json", "config.json")  # name them by id
ROLES = ("bos", "eos", "pad")
# End-of-text tokens by their usual names: GPT-2's, Llama 3's, sentencepiece's, Gemma's.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def _first_line(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return lines[0] if lines else type(error).__name__


def read_json_object(path: str) -> dict:
    """A JSON object file, ``{}`` when there is none; ValueError naming it when unreadable."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{path} is not readable JSON ({_first_line(e)}); fix or remove it"
        ) from None
    return value if isinstance(value, dict) else {}


def _content(
    value: str | int | float | bool | list[object] | dict[str, object] | None,
) -> str | None:
    """A token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``, or a directory holding one (a
    :class:`~megatronish.data.tokenizer.Tokenizer`)."""

    def __init__(self, path: str) -> None:
        self.model_path = os.path.expanduser(path)
        isdir = os.path.isdir(self.model_path)
        self.json_path = (
            os.path.join(self.model_path, HF_TOKENIZER_FILE) if isdir else self.model_path
        )
        self.directory = os.path.dirname(os.path.abspath(self.json_path))
        try:
            self._tok = tokenizers.Tokenizer.from_file(self.json_path)
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception
            raise ValueError(
                f"{self.json_path} is not a Hugging Face tokenizer.json ({_first_line(e)}); "
                "save it again with tokenizers or transformers"
            ) from None
        self._tok.encode_special_tokens = True  # "<|endoftext|>" in text is text
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        self._special = self._special_ids()
        if "eos_token_id" not in self._special:
            raise ValueError(
                f"{self.json_path} names no eos (end-of-document) token: none of "
                f"{', '.join(TOKEN_FILES + ID_FILES)} beside it names one and it has no special "
                f"token {' or '.join(EOS_NAMES)}; write "
                f'{os.path.join(self.directory, TOKEN_FILES[0])} with {{"eos_token": "<its '
                'end-of-text token>"}'
            )
        self.eod_id: int = self._special["eos_token_id"]

    def _named(self, files: dict, role: str):
        """``(file name, what it names, the id or None when this tokenizer lacks it)`` for each
        companion file that names ``role``'s token, in the order they are asked."""
        key = f"{role}_token_id"
        for name in TOKEN_FILES:
            if (token := _content(files[name].get(f"{role}_token"))) is not None:
                yield name, f"{role}_token {token!r}", self._tok.token_to_id(token)
        for name in ID_FILES:
            value = files[name].get(key)
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int) and not isinstance(value, bool):
                yield name, f"{key}={value}", value if 0 <= value < self._vocab_size else None

    def _special_ids(self) -> dict[str, int]:
        """bos / eos / pad ids (see the module docstring): a file naming a token this tokenizer
        lacks is refused for eos, passed over for bos and pad (not needed to train)."""
        files = {
            name: read_json_object(os.path.join(self.directory, name))
            for name in TOKEN_FILES + ID_FILES
        }
        ids: dict[str, int] = {}
        for role in ROLES:
            for name, named, token_id in self._named(files, role):
                if token_id is not None:
                    ids[f"{role}_token_id"] = token_id
                    break
                if role == "eos":
                    raise ValueError(
                        f"{os.path.join(self.directory, name)} names {named}, which "
                        f"{self.json_path} ({self._vocab_size} ids) does not have; fix {name}"
                    )
        if "eos_token_id" not in ids:
            special = {
                t.content for t in self._tok.get_added_tokens_decoder().values() if t.special
            }
            named = [name for name in EOS_NAMES if name in special]
            if len(named) == 1:
                ids["eos_token_id"] = self._tok.token_to_id(named[0])
        return ids

    def special_token_ids(self) -> dict[str, int]:
        """bos / eos / pad ids by their Hugging Face names (those the files name)."""
        return dict(self._special)

    def special_tokens(self) -> dict[str, str]:
        """bos / eos / pad tokens as text (``eos_token``: ``<|endoftext|>``)."""
        return {
            f"{key.removesuffix('_id')}": self._tok.id_to_token(i)
            for key, i in self._special.items()
        }

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (added tokens included)."""
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added, no EOD appended)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text: one after another for ``num_threads=1`` (worker processes),
        on the library's thread pool otherwise (its size: ``RAYON_NUM_THREADS``)."""
        if num_threads <= 1:
            return [self.encode(t) for t in texts]
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens included)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"
