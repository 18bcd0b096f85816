"""Bad input to the checkpoint tools (tools/import_hf.py, tools/export_hf.py,
tools/checkpoint_info.py) and a ``latest`` file that names no step: exit 2 for a bad argument,
3 for missing or bad input, one line on stderr naming the value and the fix, never a traceback.

The tools' ``main(argv)`` runs in this process on a tiny hand-made Llama (one layer, hidden 8);
one real subprocess checks the import end to end.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatronish.checkpoint.directory import published_latest, read_latest
from megatronish.checkpoint.format import CheckpointError, resolve_step_dir
from megatronish.checkpoint.resume import auto_candidates
from megatronish.testing.cli import assert_one_line, load_tool, run_main

REPO = Path(__file__).resolve().parents[2]
VOCAB, HIDDEN, FFN = 300, 8, 16  # the vocabulary pads to 384 rows


IMPORT, EXPORT, INFO = load_tool("import_hf"), load_tool("export_hf"), load_tool("checkpoint_info")


def hf_llama(directory: Path, **config) -> Path:
    """A one-layer Llama in HF's layout: config.json + model.safetensors."""
    directory.mkdir(parents=True)
    cfg = {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        **config,
    }
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "lm_head.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
        **{f"model.layers.0.self_attn.{p}_proj.weight": (HIDDEN, HIDDEN) for p in "qkvo"},
        "model.layers.0.mlp.gate_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, FFN),
    }
    state = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """HF model directories (good and damaged) and a checkpoint imported from the good one."""
    d = tmp_path_factory.mktemp("hf")
    hf_llama(d / "hf")
    shutil.copytree(d / "hf", d / "truncated")
    weights = d / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (d / "no_config").mkdir()
    hf_llama(d / "bad_json")
    (d / "bad_json" / "config.json").write_text("{not json")
    hf_llama(d / "no_weights")
    (d / "no_weights" / "model.safetensors").unlink()
    hf_llama(d / "no_hidden")
    cfg = json.loads((d / "no_hidden" / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "no_hidden" / "config.json").write_text(json.dumps(cfg))
    hf_llama(d / "bert", model_type="bert")
    assert IMPORT.main([str(d / "hf"), str(d / "ckpt")]) == 0
    (d / "afile").write_text("x")
    return d


# -- tools/import_hf.py ---------------------------------------------------------------------------

# (HF dir, CKPT dir, extra arguments, exit code, fragment of the line), paths under the work dir
IMPORT_CASES = [
    ("hf", "new1", ["--seq-length", "-5"], 2, "--seq-length -5 must be >= 1"),
    ("hf", "new1", ["--seq-length", "0"], 2, "--seq-length 0 must be >= 1"),
    ("hf", "new1", ["--seq-length", "x"], 2, "invalid int value: 'x'"),
    ("hf", "new1", ["--seq-length", "64"], 2, "--seq-length 64 exceeds the model's 32 positions"),
    ("hf", "ckpt", [], 2, "{d}/ckpt already holds ['latest', 'step_0000000']; pass --force"),
    ("hf", "afile", [], 2, "CKPT_DIR {d}/afile is a file, not a directory"),
    ("nowhere", "new1", [], 3, "HF_DIR {d}/nowhere is not a directory"),
    ("no_config", "new1", [], 3, "{d}/no_config/config.json does not exist"),
    ("bad_json", "new1", [], 3, "{d}/bad_json/config.json is not readable JSON"),
    ("no_weights", "new1", [], 3, "has no model.safetensors (or model.safetensors.index.json)"),
    (
        "truncated",
        "new1",
        [],
        3,
        "{d}/truncated/model.safetensors is not a readable safetensors file",
    ),
    ("no_hidden", "new1", [], 3, "config.json has no 'hidden_size'"),
    ("bert", "new1", [], 3, "cannot import model_type='bert'"),
]


@pytest.mark.parametrize(
    "hf, ckpt, extra, code, fragment",
    IMPORT_CASES,
    ids=[f"{c[0]} {c[1]} {' '.join(c[2])}" for c in IMPORT_CASES],
)
def test_import_hf_refuses(work, capfd, hf, ckpt, extra, code, fragment):
    got, out, err = run_main(IMPORT.main, [work / hf, work / ckpt, *extra], capfd)
    assert_one_line(got, err, code, fragment.format(d=work))
    assert out == ""
    assert not (work / "new1").exists() or os.listdir(work / "new1") == []


def test_import_hf_refuses_the_truncated_file_from_the_command_line(work):
    """The real process: the line and the code, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "import_hf.py"),
            str(work / "truncated"),
            str(work / "new2"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line(proc.returncode, proc.stderr, 3, "it may be truncated: re-download it")


# -- tools/export_hf.py ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def damaged(work):
    """Checkpoint dirs whose ``latest`` names no step, and one with a truncated shard file."""
    for name, content in (("hello", b"hello\n"), ("junk", b"\x00\xff\x9c junk"), ("empty", b"")):
        (work / f"latest_{name}").mkdir()
        (work / f"latest_{name}" / "latest").write_bytes(content)
    shutil.copytree(work / "ckpt", work / "cut")
    shard = next((work / "cut" / "step_0000000").glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    shutil.copytree(work / "ckpt", work / "text")
    (work / "text" / "step_0000000" / "metadata.json").write_bytes(b"\xff\xfe\x00binary")
    return work


# (CKPT, extra arguments, exit code, fragment of the line)
EXPORT_CASES = [
    ("ckpt", ["--vocab-size", "-5"], 2, "--vocab-size -5 must be >= 1"),
    ("ckpt", ["--vocab-size", "0"], 2, "--vocab-size 0 must be >= 1"),
    (
        "ckpt",
        ["--vocab-size", "385"],
        2,
        "--vocab-size 385 does not fit {d}/ckpt/step_0000000: its embedding has 384 rows",
    ),
    ("ckpt", ["--vocab-size", "100"], 2, "so the real vocabulary is 257..384"),
    ("ckpt", ["--dtype", "int8"], 2, "argument --dtype: invalid choice: 'int8'"),
    ("nowhere", [], 3, "no checkpoint at {d}/nowhere"),
    (
        "latest_hello",
        [],
        3,
        "{d}/latest_hello/latest holds 'hello', not a step directory name (step_XXXXXXX); pass one",
    ),
    ("latest_junk", [], 3, "latest holds '\\x00\\ufffd\\ufffd junk', not a step directory name"),
    ("cut", [], 3, "model-rank00000.safetensors"),
]


@pytest.mark.parametrize(
    "ckpt, extra, code, fragment",
    EXPORT_CASES,
    ids=[f"{c[0]} {' '.join(c[1])}" for c in EXPORT_CASES],
)
def test_export_hf_refuses(damaged, capfd, ckpt, extra, code, fragment):
    out_dir = damaged / "export"
    got, _, err = run_main(EXPORT.main, [damaged / ckpt, out_dir, *extra], capfd)
    assert_one_line(got, err, code, fragment.format(d=damaged))
    assert not out_dir.exists() or os.listdir(out_dir) == []


def test_export_hf_refuses_an_out_dir_that_is_a_file(damaged, capfd):
    code, _, err = run_main(EXPORT.main, [damaged / "ckpt", damaged / "afile"], capfd)
    assert_one_line(code, err, 2, f"OUT_DIR {damaged}/afile is a file, not a directory")


def test_export_hf_takes_a_real_vocab_size_that_pads_to_the_embedding(damaged, capfd):
    code, out, err = run_main(
        EXPORT.main, [damaged / "ckpt", damaged / "ok", "--vocab-size", "290"], capfd
    )
    assert code == 0 and "vocab 290" in out, err
    assert sorted(os.listdir(damaged / "ok")) == ["config.json", "model.safetensors"]


# -- tools/checkpoint_info.py ---------------------------------------------------------------------

INFO_CASES = [
    ("nowhere", [], 3, "no checkpoint at {d}/nowhere"),
    ("latest_hello", [], 3, "{d}/latest_hello/latest holds 'hello', not a step directory name"),
    ("latest_empty", [], 3, "{d}/latest_empty/latest holds '', not a step directory name"),
    ("latest_junk", [], 3, "not a step directory name"),
    ("text", [], 3, "cannot read {d}/text/step_0000000/metadata.json"),
    ("ckpt", ["--max-rows", "0"], 2, "--max-rows 0 must be >= 1"),
    ("ckpt", ["--verbose"], 2, "unrecognized arguments: --verbose"),
]


@pytest.mark.parametrize(
    "ckpt, extra, code, fragment", INFO_CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in INFO_CASES]
)
def test_checkpoint_info_refuses(damaged, capfd, ckpt, extra, code, fragment):
    got, out, err = run_main(INFO.main, [damaged / ckpt, *extra], capfd)
    assert_one_line(got, err, code, fragment.format(d=damaged))
    assert out == ""


def test_checkpoint_info_describes_a_good_checkpoint(damaged, capfd):
    code, out, err = run_main(INFO.main, [damaged / "ckpt", "--verify"], capfd)
    assert code == 0 and "verify: OK" in out, err


# -- ``latest`` that names no step: resume says why and tries the published steps ---------------


def test_resume_logs_why_latest_is_not_used_and_tries_the_published_steps(damaged):
    ckpt = damaged / "resume"
    for step in (3, 5):
        (ckpt / f"step_{step:07d}").mkdir(parents=True)
    for content, shown in (
        (b"hello\n", "'hello'"),
        (b"\x00\xff", "'\\x00\\ufffd'"),
        (b"../../etc", "'../../etc'"),
    ):
        (ckpt / "latest").write_bytes(content)
        logged = []
        assert auto_candidates(str(ckpt), logged.append) == [5, 3]
        assert logged == [
            f"{ckpt}/latest holds {shown}, not a step directory name (step_XXXXXXX); trying the "
            "published steps newest first"
        ]
        assert read_latest(str(ckpt)) is None and published_latest(str(ckpt)) is None
        with pytest.raises(CheckpointError, match="not a step directory name") as e:
            resolve_step_dir(str(ckpt))
        assert len(str(e.value).splitlines()) == 1
    (ckpt / "latest").write_text("step_0000003")
    logged = []
    assert auto_candidates(str(ckpt), logged.append) == [3] and logged == []
