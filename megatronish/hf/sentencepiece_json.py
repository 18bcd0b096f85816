"""A sentencepiece BPE model as a Hugging Face ``tokenizer.json`` that encodes exactly like it.

The lossless models of tools/train_tokenizer.py (identity normalisation, no dummy prefix, byte
fallback) map onto the ``tokenizers`` library directly: the same vocabulary and ids, BPE merges
ranked by the score of the piece they make (sentencepiece merges the best-scoring pair first),
spaces written as ``▁`` before merging, byte fallback for what no piece covers, and ``<unk>``
``<s>`` ``</s>`` as special tokens. :func:`mismatches` checks the result against sentencepiece
itself on probe texts; models with other settings fail it and are not converted.
"""

from __future__ import annotations

import sentencepiece as spm
import tokenizers
from tokenizers import decoders, models, normalizers

SPACE = "▁"  # sentencepiece's visible space
# Texts whose ids must agree besides every piece and every run of three neighbouring pieces:
# code with indentation, tabs, blank lines and CRLF; digits; accents, CJK, emoji (byte fallback).
PROBES = (
    "def f(x):\n    return x  # tab\there\n\n\n        pass\r\n",
    "  two leading spaces, two trailing  ",
    "x = [1, 22, 333]; y = 4.5e-6",
    "ünïcode ✓ 日本語 😀 ȸ",
    "\t\t\n \n",
)


def _is_normal(sp: spm.SentencePieceProcessor, i: int) -> bool:
    return not (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))


def sentencepiece_to_hf(model_path: str) -> tokenizers.Tokenizer:
    """The ``tokenizers`` BPE tokenizer of the sentencepiece model at ``model_path``."""
    sp = spm.SentencePieceProcessor(model_file=model_path)
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    normal = {sp.id_to_piece(i): i for i in range(n) if _is_normal(sp, i)}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-sp.get_score(i), i, left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = sp.id_to_piece(sp.unk_id())
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    tok.add_special_tokens(
        [tokenizers.AddedToken(sp.id_to_piece(i), special=True, normalized=False) for i in special]
    )
    return tok


def probe_texts(sp: spm.SentencePieceProcessor) -> list[str]:
    """:data:`PROBES`, the text of every piece, and of every three neighbouring pieces."""
    pieces = [
        sp.id_to_piece(i).replace(SPACE, " ")
        for i in range(sp.get_piece_size())
        if _is_normal(sp, i)
    ]
    return [*PROBES, *pieces, *("".join(pieces[i : i + 3]) for i in range(len(pieces)))]


def mismatches(model_path: str, tok: tokenizers.Tokenizer) -> tuple[int, int]:
    """``(texts encoded differently, texts tried)`` by sentencepiece and ``tok`` (no special
    tokens added, special-token text as text, as megatronish encodes)."""
    sp = spm.SentencePieceProcessor(model_file=model_path)
    texts = probe_texts(sp)
    literal = tok.encode_special_tokens
    tok.encode_special_tokens = True
    try:
        theirs = tok.encode_batch(texts, add_special_tokens=False)
    finally:
        tok.encode_special_tokens = literal
    ours = sp.encode(texts, out_type=int)
    return sum(a != b.ids for a, b in zip(ours, theirs)), len(texts)


def special_tokens(model_path: str) -> dict[str, str]:
    """``unk_token`` / ``bos_token`` / ``eos_token`` / ``pad_token`` pieces the model has, by
    their ``tokenizer_config.json`` names."""
    sp = spm.SentencePieceProcessor(model_file=model_path)
    ids = {
        "unk_token": sp.unk_id(),
        "bos_token": sp.bos_id(),
        "eos_token": sp.eos_id(),
        "pad_token": sp.pad_id(),
    }
    return {name: sp.id_to_piece(i) for name, i in ids.items() if i >= 0}


def adds_dummy_prefix(model_path: str) -> bool:
    """Whether the model writes a space before the text (sentencepiece's ``add_dummy_prefix``)."""
    sp = spm.SentencePieceProcessor(model_file=model_path)
    return sp.encode("a", out_type=str)[0].startswith(SPACE)
