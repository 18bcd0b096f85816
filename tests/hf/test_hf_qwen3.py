"""Qwen3 and Qwen3-MoE export / import: logits parity with transformers' Qwen3ForCausalLM and
Qwen3MoeForCausalLM both ways, bit-identical round trips, the refusals, and the import/export
tools.

Tiny fp32 models on the CPU, heads narrower than hidden_size / heads (h 32, 4 heads of 12) so a
model that ignored ``head_dim`` could not load. The parity tests check that dropping the per-head
norms or swapping a router's rows moves the logits far beyond the tolerance.
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
    load_hf,
    our_logits,
    our_model,
    perturb_norms,
    tensors_of,
    tool,
)
from megatronish.testing.runs import build_trainer

HEAD_DIM = 12  # 4 heads of 12 in a width of 32
SHAPES = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}


def our_config(experts: int = 5, renormalize: bool = False, **values) -> dict:
    """A tiny Qwen3-style ``model`` config section (``experts=0``: dense)."""
    router = RouterConfig(
        renormalize=renormalize,
        aux_loss_coef=0.02,
        **{k: values.pop(k) for k in ("score", "bias_update_rate") if k in values},
    )
    moe = MoEConfig(num_experts=experts, top_k=3, ffn_hidden_size=24, router=router, **values)
    return dataclasses.asdict(
        ModelConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            head_dim=HEAD_DIM,
            qk_norm=True,
            ffn_hidden_size=40,
            seq_length=SEQ,
            vocab_size=VOCAB,
            rope_theta=5e5,
            norm_eps=1e-6,
            init_std=0.2,
            moe=moe,
        )
    )


def random_qwen3(moe: bool = True, **values):
    """A random transformers Qwen3-MoE (or dense Qwen3) of the tiny shapes."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        **SHAPES,
        head_dim=HEAD_DIM,
        intermediate_size=40,
        num_hidden_layers=2,
        max_position_embeddings=64,
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        rms_norm_eps=1e-6,
        bos_token_id=5,
        eos_token_id=6,
    )
    if moe:
        config = Qwen3MoeConfig(
            **common,
            moe_intermediate_size=24,
            num_experts=5,
            num_experts_per_tok=3,
            norm_topk_prob=values.pop("norm_topk_prob", False),
            router_aux_loss_coef=0.02,
            **values,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, **values))
    perturb_norms(model, 13)
    return model.eval()


@torch.no_grad()
def assert_wiring_matters(model, reference: torch.Tensor) -> None:
    """Dropping the query norm's weights or swapping two experts' router rows moves the logits
    by far more than TOL (so the parity checks would catch either mistake)."""
    attn = model.model.layers[0].self_attn
    saved = attn.q_norm.weight.clone()
    attn.q_norm.weight.fill_(1.0)
    moved = (hf_logits(model) - reference).abs().max().item()
    attn.q_norm.weight.copy_(saved)
    assert moved > 1000 * TOL, ("q_norm", moved)
    gate = getattr(model.model.layers[0].mlp, "gate", None)
    if gate is not None:
        saved = gate.weight.clone()
        gate.weight.copy_(saved[[1, 0, 2, 3, 4]])
        moved = (hf_logits(model) - reference).abs().max().item()
        gate.weight.copy_(saved)
        assert moved > 1000 * TOL, ("router", moved)


EXPORTS = {
    "moe": ({"renormalize": False}, "Qwen3MoeForCausalLM"),
    "moe-renormalized": ({"renormalize": True}, "Qwen3MoeForCausalLM"),
    "dense": ({"experts": 0}, "Qwen3ForCausalLM"),
}


@pytest.mark.parametrize("case", EXPORTS)
def test_export_matches_transformers(case, tmp_path):
    values, architecture = EXPORTS[case]
    cfg = our_config(**values)
    chunk = our_model(cfg)
    config, state = to_hf(tensors_of(chunk), cfg)
    assert config["architectures"] == [architecture] and config["head_dim"] == HEAD_DIM
    if "moe" in case:
        assert config["norm_topk_prob"] == values["renormalize"]
        assert "model.layers.1.mlp.experts.4.up_proj.weight" in state
    hf = load_hf(config, state, tmp_path)
    assert type(hf).__name__ == architecture
    ours, theirs = our_logits(chunk), hf_logits(hf)
    diff = (ours - theirs).abs().max().item()
    print(f"{case} export: max |megatronish - transformers| logits = {diff:.2e}")
    assert ours.shape == theirs.shape == (2, SEQ, VOCAB) and diff <= TOL
    assert_wiring_matters(hf, theirs)


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_import_matches_transformers(moe):
    hf = random_qwen3(moe, **({"norm_topk_prob": True} if moe else {}))
    cfg, tensors = from_hf(hf.config.to_dict(), hf.state_dict(), seq_length=SEQ)
    assert (cfg["head_dim"], cfg["qk_norm"]) == (HEAD_DIM, True)
    if moe:
        assert cfg["moe"]["router"]["renormalize"] is True
        assert (cfg["moe"]["ffn_hidden_size"], cfg["ffn_hidden_size"]) == (24, 40)
    ours, theirs = our_logits(our_model(cfg, tensors)), hf_logits(hf)
    diff = (ours - theirs).abs().max().item()
    print(f"import: max |megatronish - transformers| logits = {diff:.2e}")
    assert diff <= TOL
    assert_wiring_matters(hf, theirs)


def test_round_trips_are_bit_identical(tmp_path):
    tensors = tensors_of(our_model(our_config()))
    config, state = to_hf(tensors, our_config())
    cfg, back = from_hf(config, state, seq_length=SEQ)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[n], t) for n, t in tensors.items())
    mine = our_config()
    assert cfg["moe"] == {**mine["moe"], "router": {**mine["moe"]["router"], "z_loss_coef": 0.0}}

    hf = random_qwen3()
    hf.save_pretrained(tmp_path)  # per-expert checkpoint names
    saved = load_file(str(tmp_path / "model.safetensors"))
    cfg, tensors = from_hf(json.loads((tmp_path / "config.json").read_text()), saved, SEQ)
    _, fused = from_hf(hf.config.to_dict(), hf.state_dict(), SEQ)
    assert all(torch.equal(fused[n], t) for n, t in tensors.items())
    _, again = to_hf(tensors, cfg)
    assert again.keys() == saved.keys()
    assert all(torch.equal(again[n], t) for n, t in saved.items())


REFUSED = {
    "layer_freq": ({"layer_freq": 2}, "model.moe.layer_freq=2: megatronish's experts sit in"),
    "shared": ({"shared_experts": 1}, "model.moe.shared_experts=1: Qwen3-MoE has no always-on"),
    "sigmoid": ({"score": "sigmoid"}, "model.moe.router.score=sigmoid: Qwen3-MoE's router is"),
    "expert-bias": ({"bias_update_rate": 0.0}, "model.moe.router.bias_update_rate=0.0: Qwen3-MoE"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_export_refuses_what_qwen3_cannot_hold(case):
    values, message = REFUSED[case]
    tensors = {"embedding.word.weight": torch.zeros(128, 32)}
    with pytest.raises(ValueError, match="cannot export as Qwen3MoeForCausalLM: " + message):
        to_hf(tensors, our_config(**values))
    cfg = our_config(experts=0)
    cfg["bias"] = True
    with pytest.raises(ValueError, match="Qwen3ForCausalLM: model.bias=true"):
        to_hf(tensors, cfg)
    cfg = {**our_config(experts=0), "arch": "gpt2"}
    with pytest.raises(ValueError, match="model.arch='gpt2' with model.qk_norm=true"):
        to_hf(tensors, cfg)


def test_import_refuses_what_megatronish_does_not_implement():
    hf = random_qwen3()
    config, state = hf.config.to_dict(), hf.state_dict()
    with pytest.raises(ValueError, match="sliding_window=8 is shorter than the sequence"):
        from_hf({**config, "use_sliding_window": True, "sliding_window": 8}, state, SEQ)
    from_hf({**config, "use_sliding_window": True, "sliding_window": SEQ}, state, SEQ)
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        from_hf({**config, "decoder_sparse_step": 2}, state, SEQ)
    with pytest.raises(ValueError, match="mlp_only_layers=\\[1\\]"):
        from_hf({**config, "mlp_only_layers": [1]}, state, SEQ)
    with pytest.raises(ValueError, match="attention_bias=true"):
        from_hf({**config, "attention_bias": True}, state, SEQ)
    missing = {k: v for k, v in state.items() if "k_norm" not in k}
    with pytest.raises(ValueError, match="no 'model.layers.0.self_attn.k_norm.weight'"):
        from_hf(config, missing, SEQ)


def test_import_and_export_tools(tmp_path, capsys):
    hf = random_qwen3()
    hf.save_pretrained(tmp_path / "hf")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert tool("import_hf").main([str(tmp_path / "hf"), ckpt, "--seq-length", str(SEQ)]) == 0
    overrides = capsys.readouterr().out.splitlines()[-3].split()
    assert {"model.head_dim=12", "model.qk_norm=true", "model.moe.num_experts=5"} <= set(overrides)
    # A run with the printed overrides loads the checkpoint and computes transformers' function.
    trainer = build_trainer(0, 1, [], steps=1, model=overrides)
    load_into(trainer.checkpoint_parts, ckpt)
    diff = (our_logits(trainer.chunks[0].eval()) - hf_logits(hf)).abs().max().item()
    assert diff <= TOL, diff

    assert tool("export_hf").main([ckpt, out]) == 0
    config = json.loads(Path(out, "config.json").read_text())
    assert (config["model_type"], config["head_dim"], config["norm_topk_prob"]) == (
        "qwen3_moe",
        HEAD_DIM,
        False,
    )
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(Path(out, "model.safetensors")))
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], t) for n, t in before.items())
