"""Mixtral export / import: logits parity with transformers' MixtralForCausalLM both ways,
bit-identical round trips, the refusals, and tools/import_hf.py + tools/export_hf.py.

Tiny fp32 models on the CPU. Shapes differ pairwise (h 32, expert ffn 24, 5 experts, top 3), so
a transposed tensor cannot load, and the parity tests check that swapping gate and up or two
router rows moves the logits far beyond the tolerance.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatronish.checkpoint.load import load_into
from megatronish.config.schema import ModelConfig, MoEConfig, RouterConfig
from megatronish.hf.from_hf import from_hf
from megatronish.hf.to_hf import to_hf
from megatronish.testing.hf_models import (
    SEQ,
    TOL,
    VOCAB,
    hf_logits,
    our_logits,
    our_model,
    perturb_norms,
    tensors_of,
    tool,
)
from megatronish.testing.hf_models import load_hf as load_hf_model
from megatronish.testing.runs import build_trainer

# Values away from megatronish's and transformers' defaults.
MOE = {"num_experts": 5, "top_k": 3, "ffn_hidden_size": 24, "aux_loss_coef": 0.02}
HF_VALUES = {
    "num_local_experts": 5,
    "num_experts_per_tok": 3,
    "intermediate_size": 24,
    "router_aux_loss_coef": 0.02,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-6,
    "sliding_window": None,
    "tie_word_embeddings": False,
}


def our_config(arch: str = "llama", bias: bool = False, **moe) -> dict:
    """A tiny mixture-of-experts ``model`` config section as a plain dict."""
    router_keys = ("renormalize", "score", "bias_update_rate", "num_groups", "max_groups")
    router = RouterConfig(
        aux_loss_coef=MOE["aux_loss_coef"], **{k: moe.pop(k) for k in router_keys if k in moe}
    )
    group = MoEConfig(
        num_experts=MOE["num_experts"],
        top_k=MOE["top_k"],
        ffn_hidden_size=MOE["ffn_hidden_size"],
        router=router,
        **moe,
    )
    return dataclasses.asdict(
        ModelConfig(
            arch=arch,
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=48,
            seq_length=SEQ,
            vocab_size=VOCAB,
            rope_theta=5e5,
            norm_eps=1e-6,
            init_std=0.2,
            bias=bias,
            moe=group,
        )
    )


def load_hf(config: dict, state: dict, path: Path):
    model = load_hf_model(config, state, path)
    assert type(model).__name__ == "MixtralForCausalLM"
    return model


def random_mixtral(**values):
    """A random transformers Mixtral of the tiny shapes."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=5,
        num_experts_per_tok=3,
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        rms_norm_eps=1e-6,
        router_aux_loss_coef=0.02,
        bos_token_id=5,
        eos_token_id=6,
        **values,
    )
    model = MixtralForCausalLM(config)
    perturb_norms(model, 13)
    return model.eval()


@torch.no_grad()
def assert_wiring_matters(model, reference: torch.Tensor) -> None:
    """Swapping gate and up, or two experts' router rows, moves the logits by far more than TOL
    (so the parity checks would catch either mistake)."""
    for layer in model.model.layers:
        moe = layer.mlp
        f = moe.experts.gate_up_proj.shape[1] // 2
        for swap in ("gate_up", "router"):
            saved = (moe.experts.gate_up_proj.clone(), moe.gate.weight.clone())
            if swap == "gate_up":
                moe.experts.gate_up_proj.copy_(saved[0].roll(f, dims=1))
            else:
                moe.gate.weight.copy_(saved[1][[1, 0, 2, 3, 4]])
            moved = (hf_logits(model) - reference).abs().max().item()
            moe.experts.gate_up_proj.copy_(saved[0])
            moe.gate.weight.copy_(saved[1])
            assert moved > 1000 * TOL, (swap, moved)


def test_export_matches_transformers(tmp_path):
    chunk = our_model(our_config())
    config, state = to_hf(tensors_of(chunk), our_config())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    assert {k: config[k] for k in HF_VALUES} == HF_VALUES
    assert "model.layers.1.block_sparse_moe.experts.4.w3.weight" in state
    hf = load_hf(config, state, tmp_path)
    ours, theirs = our_logits(chunk), hf_logits(hf)
    diff = (ours - theirs).abs().max().item()
    print(f"export: max |megatronish - transformers| logits = {diff:.2e}")
    assert ours.shape == theirs.shape == (2, SEQ, VOCAB) and diff <= TOL
    assert_wiring_matters(hf, theirs)


def test_import_matches_transformers():
    hf = random_mixtral()
    cfg, tensors = from_hf(hf.config.to_dict(), hf.state_dict(), seq_length=SEQ)
    ours, theirs = our_logits(our_model(cfg, tensors)), hf_logits(hf)
    diff = (ours - theirs).abs().max().item()
    print(f"import: max |megatronish - transformers| logits = {diff:.2e}")
    assert diff <= TOL
    assert_wiring_matters(hf, theirs)


def test_import_records_the_moe_group():
    hf = random_mixtral()
    cfg, _ = from_hf(hf.config.to_dict(), hf.state_dict(), SEQ)
    assert cfg["moe"] == {
        "num_experts": 5,
        "top_k": 3,
        "layer_freq": 1,
        "ffn_hidden_size": 24,
        "shared_experts": 0,
        "capacity_factor": None,
        "router": {
            "score": "softmax",
            "renormalize": True,
            "aux_loss_coef": 0.02,
            "z_loss_coef": 0.0,
            "bias_update_rate": None,
            "num_groups": None,
            "max_groups": None,
        },
    }
    assert (cfg["ffn_hidden_size"], cfg["rope_theta"], cfg["norm_eps"]) == (24, 5e5, 1e-6)


def test_round_trips_are_bit_identical(tmp_path):
    tensors = tensors_of(our_model(our_config()))
    config, state = to_hf(tensors, our_config())
    cfg, back = from_hf(config, state, seq_length=SEQ)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name
    mine = our_config()["moe"]
    assert cfg["moe"] == {**mine, "router": {**mine["router"], "z_loss_coef": 0.0}}

    hf = random_mixtral()
    hf.save_pretrained(tmp_path)  # per-expert checkpoint names
    saved = load_file(str(tmp_path / "model.safetensors"))
    cfg, tensors = from_hf(json.loads((tmp_path / "config.json").read_text()), saved, SEQ)
    _, fused = from_hf(hf.config.to_dict(), hf.state_dict(), SEQ)
    assert all(torch.equal(fused[n], t) for n, t in tensors.items())
    _, again = to_hf(tensors, cfg)
    assert again.keys() == saved.keys()
    for name, t in saved.items():
        assert torch.equal(again[name], t), name


REFUSED = {
    "gpt2": ({"arch": "gpt2"}, "model.arch='gpt2'"),
    "layer_freq": ({"layer_freq": 2}, "model.moe.layer_freq=2 leaves some blocks dense"),
    "shared": ({"shared_experts": 1}, "model.moe.shared_experts=1: Mixtral has no always-on"),
    "renormalize": ({"renormalize": False}, "model.moe.router.renormalize=false: Mixtral"),
    "bias": ({"bias": True}, "model.bias=true: Mixtral's linear layers have no biases"),
    "sigmoid": ({"score": "sigmoid"}, "model.moe.router.score=sigmoid: Mixtral's router is a"),
    "expert-bias": (
        {"bias_update_rate": 0.0},
        "model.moe.router.bias_update_rate=0.0: Mixtral's router has no expert bias",
    ),
    "groups": (
        {"num_groups": 2, "max_groups": 1},
        "model.moe.router.num_groups=2: Mixtral routes without expert groups",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_export_refuses_what_mixtral_cannot_hold(case):
    values, message = dict(REFUSED[case][0]), REFUSED[case][1]
    arch, bias = values.pop("arch", "llama"), values.pop("bias", False)
    tensors = {"embedding.word.weight": torch.zeros(128, 32)}
    with pytest.raises(ValueError, match="cannot export as MixtralForCausalLM: " + message):
        to_hf(tensors, our_config(arch, bias, **values))


def test_a_dense_model_still_exports_as_llama():
    cfg = our_config()
    cfg["moe"]["num_experts"] = 0
    config, state = to_hf(tensors_of(our_model(cfg)), cfg)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "model.layers.1.mlp.gate_proj.weight" in state


def test_import_refuses_what_megatronish_does_not_implement():
    hf = random_mixtral()
    config, state = hf.config.to_dict(), hf.state_dict()
    with pytest.raises(ValueError, match="sliding_window=8 is shorter than the sequence"):
        from_hf({**config, "sliding_window": 8}, state, seq_length=SEQ)
    from_hf({**config, "sliding_window": SEQ}, state, seq_length=SEQ)  # never reached: fine
    from_hf({**config, "router_jitter_noise": 0.1}, state, seq_length=SEQ)  # training only
    with pytest.raises(ValueError, match="this Mixtral model .* hidden_act='gelu'"):
        from_hf({**config, "hidden_act": "gelu"}, state, seq_length=SEQ)
    extra = {**state, "model.layers.0.mlp.shared_expert.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="no place for"):
        from_hf(config, extra, seq_length=SEQ)


def test_import_and_export_tools(tmp_path, capsys):
    hf = random_mixtral()
    hf.save_pretrained(tmp_path / "hf")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert tool("import_hf").main([str(tmp_path / "hf"), ckpt, "--seq-length", str(SEQ)]) == 0
    printed = capsys.readouterr().out
    overrides = printed.splitlines()[-3].split()
    assert "model.moe.num_experts=5" in overrides and "model.moe.capacity_factor=null" in overrides
    # A run with the printed overrides loads the checkpoint and computes transformers' function.
    trainer = build_trainer(0, 1, [], steps=1, model=overrides)
    assert trainer.cfg.model.moe.router.aux_loss_coef == 0.02
    load_into(trainer.checkpoint_parts, ckpt)
    diff = (our_logits(trainer.chunks[0].eval()) - hf_logits(hf)).abs().max().item()
    assert diff <= TOL, diff

    assert tool("export_hf").main([ckpt, out]) == 0
    config = json.loads(Path(out, "config.json").read_text())
    assert {k: config[k] for k in HF_VALUES} == HF_VALUES
    assert (config["bos_token_id"], config["eos_token_id"]) == (5, 6)
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(Path(out, "model.safetensors")))
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], t) for n, t in before.items())
