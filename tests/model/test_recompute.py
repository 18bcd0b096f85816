"""Recompute policies reproduce dropout masks, losses and weights bit for bit, in any layout."""

import pytest
import torch

from megatronish.model.recompute import recompute_segments
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import losses_of, merge_params, train_layout

DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
POLICIES = [
    ["trainer.recompute=selective"],
    [
        "trainer.recompute=full",
        "trainer.recompute_method=uniform",
        "trainer.recompute_num_layers=1",
    ],
    [
        "trainer.recompute=full",
        "trainer.recompute_method=uniform",
        "trainer.recompute_num_layers=3",
    ],
    ["trainer.recompute=full", "trainer.recompute_method=block", "trainer.recompute_num_layers=1"],
]
LAYOUTS = {
    "serial": (1, []),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
    "pp2-vpp2": (2, ["parallel.pp=2", "parallel.vpp=2"]),
    "zero3-dp2": (2, ["parallel.zero_stage=3"]),
}


def test_segments():
    assert recompute_segments(4, "none", "uniform", 1) == [(0, 4, False)]
    assert recompute_segments(5, "full", "uniform", 2) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert recompute_segments(4, "full", "block", 2) == [(0, 1, True), (1, 2, True), (2, 4, False)]
    assert recompute_segments(1, "full", "block", 3) == [(0, 1, True)]


def run(world, overrides, steps=3):
    if world == 1:
        return [train_layout(0, 1, overrides, steps)]
    return run_world(train_layout, world, overrides, steps)


# serial: every policy in one process, ~6 s (the others start processes).
@pytest.mark.parametrize(
    "layout", [pytest.param(x, marks=pytest.mark.slow) if x == "serial" else x for x in LAYOUTS]
)
def test_recompute_is_bit_identical(layout):
    world, args = LAYOUTS[layout]
    plain = run(world, [*DROPOUT, *args])
    for policy in POLICIES if layout == "serial" else POLICIES[:2]:
        got = run(world, [*DROPOUT, *args, *policy])
        assert losses_of(got) == losses_of(plain), policy
        a, b = merge_params(plain), merge_params(got)
        assert all(torch.equal(a[k], b[k]) for k in a), policy


def saved_bytes(overrides) -> int:
    """Bytes of the tensors autograd keeps for backward during one microbatch's forward."""
    from megatronish.testing.runs import build_trainer

    trainer = build_trainer(0, 1, [*DROPOUT, "model.seq_length=64", *overrides], 1)
    seen: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t.requires_grad is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    inputs, targets = trainer.microbatches(trainer.train_data, 0)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.chunks[0](inputs, targets)
    params = {p.untyped_storage().data_ptr() for p in trainer.chunks[0].parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def test_recompute_keeps_fewer_activations():
    none = saved_bytes([])
    selective = saved_bytes(POLICIES[0])
    full = saved_bytes(POLICIES[1])
    assert full < selective < none
