"""Tensor and sequence parallel training equals one process (fp32, gloo)."""

import pytest
import torch

from megatronish.checkpoint.gather import gather_tp_params
from megatronish.distributed.topology import Topology
from megatronish.model.build import build_chunks
from megatronish.model.parallel_context import ParallelContext
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.context import TPContext
from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import PARITY_STEPS, losses_of, train_layout

# Two microbatches of 4 per step: accumulation is exercised with half the collectives.
ARGS = ["trainer.micro_batch_size=4"]
REFERENCE: dict[str, list] = {}


def reference(arch):
    if arch not in REFERENCE:
        REFERENCE[arch] = [train_layout(0, 1, [*ARGS, f"model.arch={arch}"], PARITY_STEPS)]
    return REFERENCE[arch]


# Each (tp, sp) once, each arch with and without sp; tp=4 splits the 4 kv heads one per rank.
TP_CASES = [("llama", 2, False), ("llama", 4, True), ("gpt2", 2, True), ("gpt2", 4, False)]


@pytest.mark.parametrize("arch,tp,sp", TP_CASES)
def test_tp_sp_matches_serial(arch, tp, sp):
    ref = reference(arch)
    got = run_world(
        train_layout,
        tp,
        [*ARGS, f"model.arch={arch}", f"parallel.tp={tp}", f"parallel.sp={str(sp).lower()}"],
        PARITY_STEPS,
    )
    assert_parity(ref, got)


def test_tp1_with_sp_flag_is_the_serial_model():
    got = [train_layout(0, 1, [*ARGS, "parallel.sp=true"], PARITY_STEPS)]
    assert losses_of(got) == losses_of(reference("llama"))


def _init_params(rank, world, arch):
    topo = Topology.build(tp=world, dp=1, pp=1, rank=rank)
    spec = ModelSpec(
        arch=arch,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=64,
        seq_length=8,
        vocab_size=100,
        padded_vocab_size=128,
        max_position_embeddings=8,
        bias=arch == "gpt2",
        tie_embeddings=arch == "gpt2",
    )
    chunks = build_chunks(spec, ParallelContext(TPContext(group=topo.tp_group)), [2], seed=7)
    return gather_tp_params(chunks, topo)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_initialisation_is_layout_independent(arch):
    serial = _init_params(0, 1, arch)
    for world in (2, 4):
        gathered = run_world(_init_params, world, arch)[0]
        assert set(gathered) == set(serial)
        for name, full in serial.items():
            assert torch.equal(gathered[name], full), (world, name)


# Per-head Q/K norms (each tp rank's heads: partial weight grads summed over tp even without
# sp) and heads narrower than hidden_size / heads (the projection's input is heads * head_dim).
# llama: gpt2's LayerNorm would add a key-norm bias whose true gradient is exactly zero (as the
# key bias's), which Adam turns from round-off into per-tensor gaps.
QK_NORM = ["model.qk_norm=true", "model.head_dim=12", "model.num_query_groups=2"]


def test_qk_norm_and_head_dim_match_serial():
    args = [*ARGS, *QK_NORM]
    ref = [train_layout(0, 1, args, PARITY_STEPS)]
    assert_parity(ref, run_world(train_layout, 2, [*args, "parallel.tp=2"], PARITY_STEPS))
