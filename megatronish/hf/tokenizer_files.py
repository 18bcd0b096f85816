"""The tokenizer files of a Hugging Face export, so ``AutoTokenizer.from_pretrained(out_dir)``
gives the ids megatronish trained on.

- A Hugging Face tokenizer (``tokenizer.json``) is copied with its companion files; its
  ``tokenizer_config.json`` gets the tokenizer class and the bos / eos / pad tokens it lacks.
- A sentencepiece model is copied as ``tokenizer.model`` and converted to a ``tokenizer.json``
  (:mod:`megatronish.hf.sentencepiece_json`, checked against sentencepiece before it is
  written) with a ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``, which loads the
  tokenizer.json as it is (transformers 5's ``LlamaTokenizer`` rebuilds its own pipeline and
  would prepend a space). A model the conversion does not reproduce (another normalisation, a
  dummy prefix) gets a ``LlamaTokenizer`` config instead, for transformers to convert on load;
  the returned line says its ids were not checked.

A converted sentencepiece tokenizer adds no BOS token (``add_bos_token: false``), as
megatronish's data has none; a copied HF tokenizer_config.json keeps its own setting.
"""

from __future__ import annotations

import json
import os
import shutil

from megatronish.data.hf_tokenizer import HF_TOKENIZER_FILE, HFTokenizer, read_json_object
from megatronish.data.tokenizer import Tokenizer
from megatronish.file_modes import write_atomic

CONFIG_FILE = "tokenizer_config.json"
SPM_FILE = "tokenizer.model"
# The files of an HF tokenizer directory that are copied (config.json is the model's, not these).
COMPANIONS = (
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    SPM_FILE,
    "chat_template.jinja",
)
TOKENIZER_FILES = (HF_TOKENIZER_FILE, CONFIG_FILE, *COMPANIONS)
FAST_CLASS = "PreTrainedTokenizerFast"  # tokenizer.json as it is, in transformers 4 and 5


def _write_json(path: str, value: dict) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")

    write_atomic(path, write)


def _copy(src: str, dst: str) -> None:
    write_atomic(dst, lambda p: shutil.copyfile(src, p))


def remove_tokenizer_files(out_dir: str, keep: tuple[str, ...] = ()) -> None:
    """Remove tokenizer files of an earlier export from ``out_dir`` (but ``keep``), so a new
    model never sits beside another tokenizer."""
    for name in TOKENIZER_FILES:
        path = os.path.join(out_dir, name)
        if name not in keep and os.path.isfile(path):
            os.remove(path)


def write_tokenizer(tokenizer: Tokenizer, out_dir: str) -> str:
    """Write ``tokenizer``'s files into ``out_dir`` (replacing those of an earlier export);
    returns one line saying what was written."""
    if isinstance(tokenizer, HFTokenizer):
        written, how = _write_hf(tokenizer, out_dir), f"copied from {tokenizer.json_path}"
    else:
        written, how = _write_sentencepiece(tokenizer, out_dir)
    remove_tokenizer_files(out_dir, keep=tuple(written))
    return f"tokenizer: {', '.join(written)} ({how})"


def _write_hf(tok: HFTokenizer, out_dir: str) -> list[str]:
    written = [HF_TOKENIZER_FILE]
    _copy(tok.json_path, os.path.join(out_dir, HF_TOKENIZER_FILE))
    for name in COMPANIONS:
        if os.path.isfile(src := os.path.join(tok.directory, name)):
            _copy(src, os.path.join(out_dir, name))
            written.append(name)
    config = read_json_object(os.path.join(tok.directory, CONFIG_FILE))
    config.setdefault("tokenizer_class", FAST_CLASS)  # not the class of config.json's model
    for key, token in tok.special_tokens().items():
        if config.get(key) is None:
            config[key] = token
    _write_json(os.path.join(out_dir, CONFIG_FILE), config)
    return [*written, CONFIG_FILE]


def _spm_config(model_path: str, tokenizer_class: str) -> dict:
    from megatronish.hf.sentencepiece_json import special_tokens

    return {
        "tokenizer_class": tokenizer_class,
        **special_tokens(model_path),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def _write_sentencepiece(tok: Tokenizer, out_dir: str) -> tuple[list[str], str]:
    from megatronish.hf.sentencepiece_json import (
        adds_dummy_prefix,
        mismatches,
        sentencepiece_to_hf,
    )

    model = tok.model_path
    _copy(model, os.path.join(out_dir, SPM_FILE))
    converted = sentencepiece_to_hf(model)
    differ, tried = mismatches(model, converted)
    if differ:
        config = _spm_config(model, "LlamaTokenizer")
        config.update(legacy=False, add_prefix_space=adds_dummy_prefix(model))
        _write_json(os.path.join(out_dir, CONFIG_FILE), config)
        return [SPM_FILE, CONFIG_FILE], (
            f"sentencepiece {model}; not converted to tokenizer.json: that would encode "
            f"{differ} of {tried} probe texts differently. transformers converts tokenizer.model "
            "on load; its ids are not checked"
        )
    write_atomic(os.path.join(out_dir, HF_TOKENIZER_FILE), lambda p: converted.save(p))
    _write_json(os.path.join(out_dir, CONFIG_FILE), _spm_config(model, FAST_CLASS))
    return [HF_TOKENIZER_FILE, SPM_FILE, CONFIG_FILE], (
        f"sentencepiece {model}, converted: the same ids on {tried} probe texts"
    )
