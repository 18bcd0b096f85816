"""What a tokenizer is to the rest of megatronish, and the one loader that picks it by path.

A tokenizer path (``data.tokenizer_model``, ``--tokenizer-model`` of tools/preprocess_data.py,
``tokenizer_model=`` of generation, ``--tokenizer`` of tools/export_hf.py) is either

- a sentencepiece ``.model`` file (tools/train_tokenizer.py trains one):
  :class:`~megatronish.data.sentencepiece_tokenizer.SentencePieceTokenizer`;
- a Hugging Face ``tokenizer.json`` or a directory holding one (an HF model directory, an export
  of tools/export_hf.py): :class:`~megatronish.data.hf_tokenizer.HFTokenizer`.

Both encode text as it is written: no BOS is added, and text that spells a special token
(``</s>``, ``<|endoftext|>``) is ordinary text, so only the end-of-document id that
tools/preprocess_data.py appends ever ends a document.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Protocol

from megatronish.data.hf_tokenizer import HF_TOKENIZER_FILE, HFTokenizer
from megatronish.data.sentencepiece_tokenizer import SentencePieceTokenizer


class Tokenizer(Protocol):
    """Text <-> token ids, with the end-of-document id and the vocabulary size."""

    model_path: str  # the path it was loaded from
    eod_id: int  # the end-of-document (eos) id

    @property
    def vocab_size(self) -> int:
        """Ids are in ``[0, vocab_size)``."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS, no EOD)."""
        ...

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (lists, numpy arrays and tensors)."""
        ...

    def special_token_ids(self) -> dict[str, int]:
        """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` where the tokenizer has them."""
        ...


def directory_problem(path: str) -> str | None:
    """Why directory ``path`` is not a tokenizer (it holds no tokenizer.json), or None."""
    if os.path.isfile(os.path.join(path, HF_TOKENIZER_FILE)):
        return None
    models = sorted(glob.glob(os.path.join(glob.escape(path), "*.model")))
    hint = f"; for its sentencepiece model give {models[0]}" if models else ""
    return (
        f"{path} is a directory without a {HF_TOKENIZER_FILE}: give a sentencepiece .model "
        f"file, a Hugging Face tokenizer.json or a directory holding one{hint}"
    )


def tokenizer_in(directory: str) -> str | None:
    """The tokenizer of a model directory (an HF model, an export): the directory itself when it
    holds a tokenizer.json, else its sentencepiece ``tokenizer.model``; None when it has neither."""
    if os.path.isfile(os.path.join(directory, HF_TOKENIZER_FILE)):
        return directory
    model = os.path.join(directory, "tokenizer.model")
    return model if os.path.isfile(model) else None


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at ``path``: a Hugging Face tokenizer for a ``.json`` file or a directory
    (its ``tokenizer.json``), sentencepiece otherwise. FileNotFoundError when there is none
    there, ValueError when the file is not a usable tokenizer (one line each, with the fix)."""
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):
        if (problem := directory_problem(path)) is not None:
            raise FileNotFoundError(problem)
    elif not os.path.exists(path):
        raise FileNotFoundError(
            f"tokenizer model {path} does not exist; give a sentencepiece .model file "
            "(tools/train_tokenizer.py trains one), a Hugging Face tokenizer.json or a "
            "directory holding one"
        )
    if os.path.isdir(path) or path.endswith(".json"):
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)
