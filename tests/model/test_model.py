"""The GPT on one process: shapes, parameter count, loss, padded vocab, layer naming."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatronish.model.build import build_chunks, chunk_ids_of_stage, chunk_layer_ranges
from megatronish.model.flops import count_parameters, flops_per_token
from megatronish.model.parallel_context import ParallelContext
from megatronish.spec import ModelSpec


def spec_of(arch: str, **kw) -> ModelSpec:
    base = dict(
        arch=arch,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2 if arch == "llama" else 4,
        ffn_hidden_size=96,
        seq_length=16,
        vocab_size=300,
        padded_vocab_size=384,
        max_position_embeddings=16,
        bias=arch == "gpt2",
        tie_embeddings=arch == "gpt2",
    )
    base.update(kw)
    return ModelSpec(**base)


# Per-head Q/K norms and heads wider than hidden / heads: the parameter count follows the model.
QK = {"qk_norm": True, "kv_channels": 24}


@pytest.mark.parametrize("arch,heads", [("llama", {}), ("gpt2", {}), ("llama", QK), ("gpt2", QK)])
def test_shapes_loss_and_parameter_count(arch, heads):
    spec = spec_of(arch, **heads)
    [model] = build_chunks(spec, ParallelContext(), [2])
    ids = torch.randint(0, spec.vocab_size, (3, 17))
    hidden = model(ids[:, :-1])
    assert hidden.shape == (16, 3, 64)  # [s, b, h]
    assert model.head.logits(hidden).shape == (16, 3, 384)
    loss = model(ids[:, :-1], ids[:, 1:])
    assert abs(loss.item() - math.log(spec.vocab_size)) < 0.3  # near-uniform at init
    assert count_parameters(spec) == sum(p.numel() for p in model.parameters())
    assert flops_per_token(spec) > 6 * 2 * 64 * 64


def test_padded_logits_are_excluded_from_the_loss():
    spec = spec_of("llama")
    [model] = build_chunks(spec, ParallelContext(), [2])
    with torch.no_grad():
        model.head.weight[spec.vocab_size :] = 5.0  # padding rows would dominate if counted
    ids = torch.randint(0, spec.vocab_size, (2, 17))
    logits = model.head.logits(model(ids[:, :-1]))[..., : spec.vocab_size]
    expected = F.cross_entropy(logits.reshape(-1, spec.vocab_size), ids[:, 1:].t().reshape(-1))
    assert torch.allclose(model(ids[:, :-1], ids[:, 1:]), expected, rtol=1e-5)


def test_gpt2_head_is_tied_and_llama_is_not():
    [gpt2] = build_chunks(spec_of("gpt2"), ParallelContext(), [2])
    [llama] = build_chunks(spec_of("llama"), ParallelContext(), [2])
    assert gpt2.head.weight is None and "head.weight" not in dict(gpt2.named_parameters())
    assert llama.head.weight is not None


def test_chunks_keep_global_layer_names_and_split_evenly():
    spec = spec_of("llama", num_layers=8)
    assert [list(r) for r in chunk_layer_ranges([2, 2, 2, 2])][2] == [4, 5]
    assert chunk_ids_of_stage(1, pp=2, vpp=2) == [1, 3]
    [full] = build_chunks(spec, ParallelContext(), [8])
    parts = [c for r in range(2) for c in build_chunks(spec, ParallelContext(), [2] * 4, r, 2, 2)]
    names = {n for c in parts for n, _ in c.named_parameters()}
    assert names == {n for n, _ in full.named_parameters()}
    # Layout-independent init: every chunk's weights equal the unsplit model's.
    ref = dict(full.named_parameters())
    for c in parts:
        for n, p in c.named_parameters():
            assert torch.equal(p, ref[n]), n


def test_same_seed_same_weights_and_different_seed_different():
    spec = spec_of("llama")
    a = build_chunks(spec, ParallelContext(), [2], seed=1)[0].state_dict()
    b = build_chunks(spec, ParallelContext(), [2], seed=1)[0].state_dict()
    c = build_chunks(spec, ParallelContext(), [2], seed=2)[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.qkv.weight"], c["layers.0.attn.qkv.weight"])


def test_bf16_autocast_forward_backward_is_close_to_fp32():
    spec = spec_of("llama")
    [model] = build_chunks(spec, ParallelContext(), [2])
    ids = torch.randint(0, spec.vocab_size, (2, 17))
    ref = model(ids[:, :-1], ids[:, 1:])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(ids[:, :-1], ids[:, 1:])
    low.backward()
    assert abs(low.item() - ref.item()) < 0.05
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_parameter_carries_its_record(arch):
    """Each parameter has one ParamInfo; decay, init and tp splits follow its role."""
    from megatronish.tensor_parallel.sharding import param_info

    spec = spec_of(arch, tie_embeddings=False)
    [model] = build_chunks(spec, ParallelContext(), [2])
    for name, p in model.named_parameters():
        info = param_info(p)
        assert hasattr(p, "info"), f"{name} was never marked"
        is_norm = "norm" in name
        is_bias = name.endswith(".bias")
        assert info.weight_decay == (not is_norm and not is_bias), name
        assert info.init == (
            "ones" if is_norm and name.endswith("weight") else "zeros" if is_bias else "normal"
        ), name
        split = ("qkv", "proj.weight", "fc1", "fc2.weight", "word", "head.weight")
        assert (info.shard is not None) == any(k in name for k in split), name
        assert info.tied_to is None
