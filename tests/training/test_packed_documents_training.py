"""Packed documents in training: every layout trains like one process with document masks,
positions reset per document and EOD targets left out of the loss, on windows whose documents
are shorter than a cp chunk, longer than the window, exactly on chunk boundaries and one token
long (:class:`~megatronish.testing.synthetic.PackedPatternTokens`); and the loss is the mean over
the global batch's kept tokens."""

import pytest
import torch
import torch.nn.functional as F

from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import SYNTHETIC_EOD, build_trainer, train_layout

PACKED = [
    "data.reset_attention_mask=true",
    "data.reset_position_ids=true",
    "data.eod_mask_loss=true",
]
STEPS = 6
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]
# name: (world, arch, layout, extra model options shared with the reference)
LAYOUTS = {
    "tp2-sp": (2, "llama", ["parallel.tp=2", "parallel.sp=true"], ()),
    "pp2-vpp2": (2, "llama", ["parallel.pp=2", "parallel.vpp=2"], ()),
    "zbv": (2, "llama", ["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_schedule=zbv"], ()),
    "cp2": (2, "llama", ["parallel.cp=2"], ()),
    "cp4": (4, "llama", ["parallel.cp=4"], ()),
    "dp2-zero3": (2, "llama", ["parallel.zero_stage=3"], ()),
    "cp2-dp2-selective": (4, "llama", ["parallel.cp=2", "trainer.recompute=selective"], ()),
    "full-recompute": (1, "llama", ["trainer.recompute=full"], ()),
    "moe-ep2": (2, "llama", ["parallel.ep=2"], tuple(MOE)),
    "gpt2-tp2-sp": (2, "gpt2", ["parallel.tp=2", "parallel.sp=true"], ()),
    "gpt2-cp2": (2, "gpt2", ["parallel.cp=2"], ()),
}
_REF: dict = {}


def reference(arch: str, extra: tuple[str, ...]) -> list:
    key = (arch, extra)
    if key not in _REF:
        _REF[key] = [train_layout(0, 1, [*PACKED, f"model.arch={arch}", *extra], STEPS)]
    return _REF[key]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_documents_train_like_one_process(name):
    world, arch, layout, extra = LAYOUTS[name]
    args = [*PACKED, f"model.arch={arch}", *extra, *layout]
    got = run_world(train_layout, world, args, STEPS, timeout=300)
    assert_parity(reference(arch, extra), got)


def test_masks_change_training():
    """The parity above is not vacuous: without the options the same data trains otherwise."""
    plain = [train_layout(0, 1, ["data.reset_attention_mask=true"], 2)]
    masked = reference("llama", ())
    assert abs(plain[0].losses[0] - masked[0].losses[0]) > 1e-3


@torch.no_grad()
def test_eod_mask_loss_is_the_mean_over_the_global_batchs_kept_tokens():
    """4 microbatches of uneven kept counts: the step's loss is the sum of every kept token's
    loss over their number, computed here from plain logits and Megatron's rule (no loss where
    the input is EOD), not from the lengths the trainer uses."""
    trainer = build_trainer(0, 1, PACKED, steps=1)
    chunk = trainer.chunks[0].eval()
    batches = trainer.microbatches(trainer.train_data, 0)
    assert len(batches) == 4
    losses = [chunk(*mb) for mb in batches]
    total, kept = 0.0, 0
    for inputs, targets, docs in batches:
        logits = chunk.head.logits(chunk(inputs, None, docs)).transpose(0, 1)[..., :250]
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        keep = (inputs != SYNTHETIC_EOD).flatten()
        total += ce[keep].sum().item()
        kept += int(keep.sum())
    assert kept < 8 * 16 - 8  # several EODs: the count matters
    assert trainer._mean_loss(losses).item() == pytest.approx(total / kept, rel=1e-6)


def test_step_flops_count_each_documents_squared_length():
    """MFU's model FLOPs of a step with document masks: attention over each document's squared
    length (counted here from the EOD tokens of the inputs), not the window's."""
    trainer = build_trainer(0, 1, PACKED, steps=1)
    spec, s = trainer.spec, trainer.spec.seq_length
    trainer._host_microbatches(trainer.train_data, 0)
    pairs = 0
    for i in range(trainer.cfg.trainer.global_batch_size):
        inputs = trainer.train_data[i][:-1].tolist()
        length = 0
        for token in inputs:
            length += 1
            if token == SYNTHETIC_EOD:
                pairs, length = pairs + length * length, 0
        pairs += length * length
    span = pairs / (trainer.cfg.trainer.global_batch_size * s)
    assert span < 0.6 * s  # the synthetic documents are short
    tokens = trainer.derived.tokens_per_step
    saved = 12.0 * spec.num_layers * spec.hidden_size * (s - span) * tokens
    assert trainer._step_flops(0) == pytest.approx(trainer.flops_per_step - saved, rel=1e-12)
    assert trainer._step_flops(0) == trainer.flops_per_step  # taken once; other steps: whole
