"""What checkpoints, exports and datasets are written with: the mode the umask gives (0644 files
and 0755 directories under umask 022, 0600 / 0700 under 077), not a private one from a
temporary file (megatronish/file_modes.py).

The tests set the process umask and restore it; each writes in this thread only (one rank, one
preprocess worker), so no other file is created under the changed umask meanwhile.
"""

import contextlib
import os
import stat
from pathlib import Path

import pytest
import torch

from megatronish.checkpoint.directory import LOCK_NAME, RunLock
from megatronish.data.stdlib_corpus import ensure_stdlib_corpus
from megatronish.file_modes import current_umask, follow_umask, save_safetensors
from megatronish.testing.cli import load_tool
from megatronish.testing.runs import train_layout

MASKS = [0o022, 0o077]


@contextlib.contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def wrong_modes(root: Path, mask: int) -> list[str]:
    """Every file and directory under ``root`` (itself included) whose mode is not what
    ``open()`` / ``mkdir()`` give under ``mask``."""
    wrong = []
    for path in [root, *sorted(root.rglob("*"))]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        want = (0o777 if path.is_dir() else 0o666) & ~mask
        if mode != want:
            wrong.append(f"{path.relative_to(root.parent)}: {oct(mode)}, want {oct(want)}")
    return wrong


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A one-step checkpoint of the tiny test model (one rank)."""
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    train_layout(0, 1, [], 1, save=str(ckpt))
    return ckpt


# -- the helpers --------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", MASKS)
def test_follow_umask_gives_what_open_and_mkdir_would(tmp_path, mask):
    made = tmp_path / "made"
    made.mkdir()
    (made / "private_file").write_text("x")
    (made / "private_file").chmod(0o600)
    (made / "private_dir").mkdir(mode=0o700)
    with umask(mask):
        assert current_umask() == mask
        follow_umask(made / "private_file")
        follow_umask(made / "private_dir")
        follow_umask(made)
        save_safetensors({"a": torch.zeros(2)}, str(made / "t.safetensors"))
        (made / "by_open").write_text("x")
        (made / "by_mkdir").mkdir()
    assert wrong_modes(made, mask) == []


# -- checkpoints, exports, imports --------------------------------------------------------------
@pytest.mark.parametrize("mask", MASKS)
def test_a_saved_checkpoint_follows_the_umask(tmp_path, mask):
    with umask(mask):
        train_layout(0, 1, [], 1, save=str(tmp_path / "ckpt"))
    assert wrong_modes(tmp_path / "ckpt", mask) == []


@pytest.mark.parametrize("mask", [0o002, 0o077])
def test_the_run_lock_follows_the_umask_so_a_teammate_can_take_it_later(tmp_path, mask):
    with umask(mask):
        lock = RunLock.acquire(str(tmp_path), "run")
    lock.release()
    assert wrong_modes(tmp_path / LOCK_NAME, mask) == []  # 0664 under 002: group-writable


@pytest.mark.parametrize("mask", MASKS)
def test_an_hf_export_follows_the_umask(checkpoint, tmp_path, mask):
    with umask(mask):
        assert load_tool("export_hf").main([str(checkpoint), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert wrong_modes(tmp_path / "hf", mask) == []


@pytest.mark.parametrize("mask", MASKS)
def test_an_hf_import_follows_the_umask(checkpoint, tmp_path, mask):
    load_tool("export_hf").main([str(checkpoint), str(tmp_path / "hf")])
    with umask(mask):
        assert load_tool("import_hf").main([str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    assert wrong_modes(tmp_path / "back", mask) == []


# -- tokenizer, preprocessed data, the built-in corpus -----------------------------------------
# The first mask: ~4 s in one process.
@pytest.mark.parametrize("mask", [pytest.param(MASKS[0], marks=pytest.mark.slow), *MASKS[1:]])
def test_a_tokenizer_and_preprocessed_data_follow_the_umask(tmp_path, mask):
    text = tmp_path / "a.txt"
    text.write_text("\n".join(f"word{i} other{i % 7} thing{i % 13} " * 5 for i in range(400)))
    tok, data = tmp_path / "tok", tmp_path / "data"
    with umask(mask):
        tokenizer = ["--input", text, "--model-prefix", tok / "tok", "--vocab-size", 300]
        assert load_tool("train_tokenizer").main([*map(str, tokenizer), "--num-threads", "1"]) == 0
        prep = ["--input", text, "--tokenizer-model", tok / "tok.model"]
        prep += ["--output-prefix", data / "a"]
        assert load_tool("preprocess_data").main([*map(str, prep), "--no-progress"]) == 0
    assert sorted(p.name for p in data.iterdir()) == ["a.bin", "a.idx"]
    assert wrong_modes(tok, mask) == [] and wrong_modes(data, mask) == []


@pytest.mark.parametrize("mask", MASKS)
def test_the_stdlib_corpus_cache_follows_the_umask(tmp_path, mask):
    with umask(mask):
        ensure_stdlib_corpus(str(tmp_path / "cache"), 512, 0.5)
    assert wrong_modes(tmp_path / "cache", mask) == []
