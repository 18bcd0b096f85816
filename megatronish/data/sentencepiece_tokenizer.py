"""SentencePiece BPE tokenizer: training and a thin encode/decode wrapper.

Models are trained lossless for source code and prose: identity normalisation, no dummy
prefix, whitespace kept verbatim (runs of spaces may become pieces), byte fallback for
anything unseen, so ``decode(encode(text)) == text``. Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>``
(the end-of-document token).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import sentencepiece as spm

from megatronish.distributed.cpus import usable_cpus


class SentencePieceTokenizer:
    """A trained sentencepiece ``.model`` file (a
    :class:`~megatronish.data.tokenizer.Tokenizer`)."""

    def __init__(self, model_path: str) -> None:
        self.model_path = os.path.expanduser(model_path)
        if not os.path.isfile(self.model_path):
            raise FileNotFoundError(
                f"tokenizer model {self.model_path} does not exist; train one with "
                "tools/train_tokenizer.py (see --help)"
            )
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.model_path)
        except (RuntimeError, OSError) as e:
            raise ValueError(
                f"{self.model_path} is not a valid sentencepiece model ({e}); "
                "retrain it with tools/train_tokenizer.py"
            ) from e
        self.eod_id: int = self._sp.eos_id()
        if self.eod_id < 0:
            raise ValueError(
                f"tokenizer {self.model_path} has no </s> (eos) piece, needed as end-of-document "
                "token; retrain it with tools/train_tokenizer.py"
            )

    def special_token_ids(self) -> dict[str, int]:
        """bos / eos / pad ids by their Hugging Face names (pieces the model lacks left out)."""
        ids = {
            "bos_token_id": self._sp.bos_id(),
            "eos_token_id": self.eod_id,
            "pad_token_id": self._sp.pad_id(),
        }
        return {k: v for k, v in ids.items() if v >= 0}

    @property
    def vocab_size(self) -> int:
        """Number of pieces (ids are in ``[0, vocab_size)``)."""
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOD appended)."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text, encoded with ``num_threads`` native threads."""
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (accepts lists, numpy arrays and tensors)."""
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def train_sentencepiece(
    text_files: list[str],
    model_prefix: str,
    vocab_size: int,
    *,
    input_sentence_size: int = 2_000_000,
    num_threads: int | None = None,
    max_sentence_length: int = 16384,
) -> str:
    """Train a byte-fallback BPE model on plain-text files (one sentence per line).

    At most ``input_sentence_size`` lines are sampled. Returns the ``.model`` path
    (``model_prefix + ".model"``; a ``.vocab`` file is written next to it).
    """
    missing = [f for f in text_files if not os.path.isfile(f)]
    if missing or not text_files:
        raise FileNotFoundError(f"tokenizer training input files not found: {missing or '[]'}")
    if vocab_size < 260:
        raise ValueError(f"vocab_size={vocab_size} too small: byte fallback alone needs 259 ids")
    model_prefix = os.path.expanduser(model_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            input=",".join(text_files),
            model_prefix=model_prefix,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=1.0,
            max_sentence_length=max_sentence_length,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            num_threads=num_threads or usable_cpus(),
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(
            f"sentencepiece could not train a {vocab_size}-piece vocabulary from {text_files}: "
            f"{str(e).rstrip('.')}. Use a smaller vocab size or more text."
        ) from e
    return model_prefix + ".model"
