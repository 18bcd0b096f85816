"""Hugging Face export / import and tools/checkpoint_info.py on real multi-rank checkpoints.

Checkpoints saved with tp=2 and with pp=2 (2 ranks, 2 training steps) are exported with
tools/export_hf.py, loaded with ``transformers.AutoModelForCausalLM`` and must give megatronish's
logits (real vocabulary) to fp32 round-off; imported back with tools/import_hf.py they must give
exactly the original logits.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from megatronish.checkpoint.format import CheckpointError
from megatronish.checkpoint.load import load_into
from megatronish.checkpoint.save import CheckpointSaver
from megatronish.hf.from_hf import from_hf
from megatronish.hf.to_hf import to_hf
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, train_layout

REPO = Path(__file__).resolve().parents[2]
VOCAB = 250  # TINY_TEST_MODEL's real vocabulary (padded to 256)
# Values away from every default, so an exporter that writes a default instead cannot pass.
ARCHS = {
    "llama": ["model.rope_theta=500000", "model.norm_eps=1e-6"],
    "gpt2": ["model.arch=gpt2", "model.num_query_groups=8", "model.norm_eps=1e-6"],  # no GQA
}
HF_VALUES = {
    "llama": {"rope_theta": 500000.0, "rms_norm_eps": 1e-6},
    "gpt2": {"layer_norm_epsilon": 1e-6},
}
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}
_CACHE: dict = {}


def tool(name: str):
    """tools/<name>.py as a module (its ``main(argv)`` returns the exit code)."""
    if name not in _CACHE:
        spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _CACHE[name] = module
    return _CACHE[name]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


def checkpoint(workdir: Path, arch: str, layout: str) -> str:
    """A checkpoint of 2 training steps saved by 2 ranks in ``layout`` (made once)."""
    key = ("ckpt", arch, layout)
    if key not in _CACHE:
        path = str(workdir / f"{arch}-{layout}")
        run_world(train_layout, 2, [*ARCHS[arch], *LAYOUTS[layout]], 2, None, path, timeout=300)
        _CACHE[key] = path
    return _CACHE[key]


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def our_logits(arch: str, ckpt: str) -> torch.Tensor:
    """megatronish logits ``[b, s, VOCAB]`` of ``ckpt`` loaded into one process."""
    trainer = build_trainer(0, 1, ARCHS[arch], steps=2)
    load_into(trainer.checkpoint_parts, ckpt)
    chunk = trainer.chunks[0].eval()
    return chunk.head.logits(chunk(tokens())).transpose(0, 1)[..., :VOCAB]


@torch.no_grad()
def hf_logits(hf_dir: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()(tokens()).logits


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_export_matches_transformers_and_imports_back(workdir, arch, layout):
    ckpt = checkpoint(workdir, arch, layout)
    out = str(workdir / f"hf-{arch}-{layout}")
    assert tool("export_hf").main([ckpt, out]) == 0
    config = json.loads(Path(out, "config.json").read_text())
    assert {k: config[k] for k in HF_VALUES[arch]} == HF_VALUES[arch]
    ours, theirs = our_logits(arch, ckpt), hf_logits(out)
    assert theirs.shape == ours.shape == (2, 16, VOCAB)
    diff = (ours - theirs).abs().max().item()
    print(f"{arch} {layout}: max |megatronish - transformers| logits = {diff:.2e}")
    assert diff < 1e-5
    if layout == "tp2":  # round trip once per arch (the HF dir no longer knows the layout)
        back = str(workdir / f"back-{arch}")
        assert tool("import_hf").main([out, back]) == 0
        assert torch.equal(our_logits(arch, back), ours)


def test_llama_biases_and_tied_head_match_transformers(tmp_path):
    """Paths training does not reach above: llama with linear biases and a tied head."""
    model = ["model.bias=true", "model.tie_embeddings=true", "model.num_layers=2"]
    trainer = build_trainer(0, 1, model, steps=1)
    chunk = trainer.chunks[0].eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in chunk.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        ours = chunk.head.logits(chunk(tokens())).transpose(0, 1)[..., :VOCAB]
    tensors = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    model_cfg = OmegaConf.to_container(trainer.cfg.model, resolve=True)
    config, state = to_hf(tensors, model_cfg)
    assert "lm_head.weight" not in state and "model.layers.1.mlp.up_proj.bias" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert (ours - hf_logits(str(tmp_path))).abs().max().item() < 1e-5
    cfg_back, tensors_back = from_hf(config, state, seq_length=16)
    assert {k: cfg_back[k] for k in ("bias", "tie_embeddings", "vocab_size")} == {
        "bias": True,
        "tie_embeddings": True,
        "vocab_size": VOCAB,
    }
    for name, t in tensors.items():
        if name == "embedding.word.weight":
            t = torch.cat([t[:VOCAB], torch.zeros(256 - VOCAB, t.shape[1])])  # zero padding
        assert torch.equal(tensors_back[name], t), name


@pytest.mark.slow
def test_an_imported_llama_keeps_its_rope_theta_norm_eps_and_token_ids(tmp_path):
    """A Llama 3 style model (rope_theta 500000, rms_norm_eps 1e-6, its own special ids): the
    import records every value, a run with other values is refused until it says so, and the
    export writes them all back."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=16,
            rope_theta=500000.0,
            rms_norm_eps=1e-6,
            bos_token_id=5,
            eos_token_id=6,
            pad_token_id=7,
        )
    )
    hf.save_pretrained(tmp_path / "hf")
    assert tool("import_hf").main([str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    ids = {"bos_token_id": 5, "eos_token_id": 6, "pad_token_id": 7}
    meta = json.loads((tmp_path / "ckpt" / "step_0000000" / "metadata.json").read_text())
    assert meta["tokenizer"] == ids
    assert meta["config"]["model"]["rope_theta"] == 500000.0

    with pytest.raises(CheckpointError) as refused:  # the default rope_theta and norm_eps
        load_into(build_trainer(0, 1, [], steps=1).checkpoint_parts, str(tmp_path / "ckpt"))
    assert "model.rope_theta: checkpoint 500000.0, config 10000.0" in str(refused.value)
    assert "model.norm_eps: checkpoint 1e-06, config 1e-05" in str(refused.value)
    assert "checkpoint.allow_model_changes=[rope_theta,norm_eps]" in str(refused.value)
    allowed = build_trainer(0, 1, ["checkpoint.allow_model_changes=[rope_theta,norm_eps]"], 1)
    load_into(allowed.checkpoint_parts, str(tmp_path / "ckpt"))  # a deliberate change
    matching = build_trainer(0, 1, ["model.rope_theta=500000", "model.norm_eps=1e-6"], 1)
    load_into(matching.checkpoint_parts, str(tmp_path / "ckpt"))
    with torch.no_grad():  # the same function as transformers' under its own values
        chunk = matching.chunks[0].eval()
        ours = chunk.head.logits(chunk(tokens())).transpose(0, 1)[..., :VOCAB]
        assert (ours - hf.eval()(tokens()).logits).abs().max().item() < 1e-5

    assert tool("export_hf").main([str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids
    assert config["rope_theta"] == 500000.0 and config["rms_norm_eps"] == 1e-6


def test_an_export_over_an_earlier_model_leaves_no_file_that_contradicts_it(tmp_path):
    """An OUT_DIR holding another model's generation_config.json (whose eos id transformers'
    generate would use) and sharded weights: the export removes them, and keeps other files."""
    from transformers import AutoModelForCausalLM

    trainer = build_trainer(0, 1, [f"checkpoint.dir={tmp_path / 'ckpt'}"], steps=1)
    CheckpointSaver(trainer.cfg, trainer.checkpoint_parts).save(blocking=True)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 98, "eos_token_id": 99})
    )
    stale = [
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
    ]
    for name in stale:
        (out / name).write_bytes(b"an earlier model")
    (out / "README.md").write_text("not the export's")
    assert tool("export_hf").main([str(tmp_path / "ckpt"), str(out)]) == 0
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    generation = AutoModelForCausalLM.from_pretrained(out).generation_config
    assert (generation.bos_token_id, generation.eos_token_id) == (
        config["bos_token_id"],
        config["eos_token_id"],
    )
    assert config["eos_token_id"] != 99


def test_from_hf_refuses_what_megatronish_cannot_represent():
    cfg = {
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0},
    }
    with pytest.raises(ValueError, match="RoPE scaling 'llama3'"):
        from_hf(cfg, {})
    with pytest.raises(ValueError, match="activation_function='gelu'"):
        from_hf(
            {
                "model_type": "gpt2",
                "activation_function": "gelu",
                "vocab_size": 300,
                "n_embd": 64,
                "n_layer": 1,
                "n_head": 4,
                "n_positions": 16,
            },
            {},
        )


def test_real_vocab_size_of_a_stdlib_run_without_model_vocab():
    real = tool("export_hf").real_vocab_size
    assert (
        real({"model": {"vocab_size": None}, "data": {"source": "stdlib", "vocab_size": 4096}})
        == 4096
    )
    assert (
        real({"model": {"vocab_size": 250}, "data": {"source": "stdlib", "vocab_size": 4096}})
        == 250
    )
    assert (
        real(
            {
                "model": {"vocab_size": None},
                "data": {"source": "indexed", "tokenizer_model": "/nope"},
            }
        )
        is None
    )


def _flip_data_byte(path: str) -> None:
    """Flip one byte in the tensor data region (after the 8-byte length and the JSON header)."""
    with open(path, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        start, size = 8 + header, os.path.getsize(path)
        f.seek(start + (size - start) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.slow
def test_checkpoint_info_verify_names_the_corrupt_file(workdir, capsys):
    info = tool("checkpoint_info")
    ckpt = checkpoint(workdir, "llama", "tp2")
    assert info.main([ckpt, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "step              2" in out and "tp=2" in out and "verify: OK" in out
    bad = str(workdir / "corrupt")
    shutil.copytree(ckpt, bad)
    step_dir = os.path.join(bad, open(os.path.join(bad, "latest")).read().strip())
    _flip_data_byte(os.path.join(step_dir, "optim-rank00001.safetensors"))
    assert info.main([bad, "--verify", "--all"]) == 1
    err = capsys.readouterr().err
    assert "optim-rank00001.safetensors" in err and "checksum mismatch" in err
    assert "rank00000" not in err


def test_tools_have_help():
    for name in ("export_hf", "import_hf", "checkpoint_info"):
        done = subprocess.run(
            [sys.executable, str(REPO / "tools" / f"{name}.py"), "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
